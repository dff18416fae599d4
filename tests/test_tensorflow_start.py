"""How the runner loads TensorFlow (runner/job/startup.py): the optional imports TensorFlow and Keras try for
features the runner never calls are skipped while it loads, and load as usual afterwards; what TensorFlow made
while loading is frozen out of the garbage collector's full collections, which still run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, cli_env

LOAD = """
import gc, sys, weakref
from runner.job import startup
startup.load_tensorflow(False)
print(" ".join(sorted(name for name in ("jax", "matplotlib") if name in sys.modules)) or "-")
import jax, matplotlib.pyplot, keras
print(keras.backend.backend(), jax.numpy.add(1, 2), matplotlib.pyplot.__name__)
class Cycle:
    pass
made = Cycle()
made.me = made
gone = weakref.ref(made)
del made
gc.collect()
print(gc.isenabled(), gc.get_freeze_count() > 300_000, gone() is None)
"""


@pytest.mark.parametrize("backend, loaded", [("tensorflow", "-"), ("jax", "jax")])
def test_tensorflow_loads_without_jax_or_matplotlib_unless_keras_computes_with_jax(backend, loaded) -> None:
    ran = subprocess.run([sys.executable, "-c", LOAD], capture_output=True, text=True, timeout=300, cwd=REPO,
                         env=cli_env(KERAS_BACKEND=backend))
    assert ran.returncode == 0, ran.stderr[-3000:]
    # Frozen: the 510,000 objects (635,000 under JAX) TensorFlow and Keras made; a cycle made later is collected.
    assert ran.stdout.splitlines() == [loaded, f"{backend} 3 matplotlib.pyplot", "True True True"]

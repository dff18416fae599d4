"""Which Keras the runner trains with: decided once, before TensorFlow is imported.

TensorFlow 2.16+ ships two Keras flavours behind `tf.keras`: Keras 3 (the default) and tf-keras (Keras 2,
selected by TF_USE_LEGACY_KERAS=1). The runner uses only APIs common to both and the tests run the same
job under each, so CPU/GPU results do not depend on the choice. Keras 3 unless TF_USE_LEGACY_KERAS=1 is set
in the environment. (Multi-worker training no longer needs tf-keras: several processes run on JAX's runtime,
runner/device/processes.py.)
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

from runner import AcceleratorError


def active(environ: dict[str, str] | None = None) -> str:
    """The Keras this process trains with once `choose_keras` ran: 'tf-keras' or 'keras3'."""
    environ = os.environ if environ is None else environ
    return "tf-keras" if environ.get("TF_USE_LEGACY_KERAS", "0").lower() in ("1", "true", "yes") else "keras3"


def choose_keras(environ: dict[str, str] | None = None) -> str:
    """Sets TF_USE_LEGACY_KERAS when the runner needs tf-keras; returns 'tf-keras' or 'keras3'."""
    environ = os.environ if environ is None else environ
    legacy = environ.get("TF_USE_LEGACY_KERAS", "0").lower() in ("1", "true", "yes")
    if legacy and importlib.util.find_spec("tf_keras") is None:
        raise AcceleratorError(
            "tf-keras is needed here (multi-worker training or TF_USE_LEGACY_KERAS=1) but is not installed: "
            f"`{tf_keras_install()}` (tf-keras follows TensorFlow's version; --no-deps, as it would pull the "
            "`tensorflow` wheel beside this one)"
        )
    return "tf-keras" if legacy else "keras3"


def tf_keras_install() -> str:
    """The pip command that adds the tf-keras matching this environment's TensorFlow wheel (cpu, tpu or plain)."""
    for wheel in ("tensorflow-cpu", "tensorflow-tpu", "tensorflow"):
        try:
            major, minor = importlib.metadata.version(wheel).split(".")[:2]
        except (importlib.metadata.PackageNotFoundError, ValueError):
            continue
        return f'pip install --no-deps "tf-keras~={major}.{minor}.0"'
    return "pip install --no-deps tf-keras  # after TensorFlow: tf-keras must share its major.minor version"


def keras_module():
    """The Keras module the job trains with: `keras` (Keras 3, on the backend runner/device/backend.py chose), or
    `tf_keras` when `choose_keras` picked it. Core modules take Keras from here, not from `tf.keras`, so those
    that need nothing else of TensorFlow do not import it."""
    if active() == "tf-keras":
        import tf_keras

        return tf_keras
    import keras

    return keras

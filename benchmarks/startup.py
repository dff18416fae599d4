"""What a job pays before its first step, and what the start-up changes took off it, measured side by side.

Arms, each in fresh processes, alternated, the median of the repetitions (wall seconds and CPU seconds):
    import_tensorflow   `import tensorflow`, as any script does: TensorFlow Lite tries JAX and Keras tries
                        matplotlib.pyplot on the way
    import_runner       the runner's own load (runner/job/startup.py `load_tensorflow`), which skips those two
                        optional imports while TensorFlow loads
    job_autograph       `runner run` of the MNIST CNN for 3 steps with the runner's input functions rewritten by
                        AutoGraph before tracing, as tf.data does by default (runner/data/schema.py `plain` undone)
    job_plain           the same job as the runner runs it: its input functions traced as written
    job_traced_twice    job_plain with the optimizer's and metrics' variables left for Keras to make while it
                        traces the first step, so that TensorFlow traces it twice (runner/train/fit.py
                        `build_state` undone)
    import_unfrozen     import_runner with Python's garbage collector left as it is: running while TensorFlow
    job_unfrozen        loads, and walking what it made at every full collection after (runner/job/startup.py
                        `_import_frozen` undone)
Printed: each arm, then the ratios runner/TensorFlow for the import, plain/AutoGraph for the job's
`timing.data_init_s` (the input pipeline's set-up, where the traces happen) and its whole wall time,
plain/traced-twice for its `timing.first_step_s`, and frozen/unfrozen for the import's and the job's CPU time.

    .venv/bin/python benchmarks/startup.py [--quick] [--repeat N]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from _common import MNIST, REPO, prepared
from runner_vs_keras import cpu

IMPORTS = {
    "import_tensorflow": "import tensorflow",
    "import_runner": "from runner.job import startup; startup.load_tensorflow(False)",
    "import_unfrozen": "from runner.job import startup; startup._import_frozen = startup._import_quietly; "
                       "startup.load_tensorflow(False)",
}
# `runner run` in this process, with the runner's input functions handed to AutoGraph (the arm's only change).
_JOB = """
import sys
from runner.data import schema
from runner.job import startup
from runner.train import fit
if sys.argv[1] == "autograph":
    schema.plain = lambda fn, user=None: fn
if sys.argv[1] == "traced_twice":
    fit.build_state = lambda model, element_spec: None
if sys.argv[1] == "unfrozen":
    startup._import_frozen = startup._import_quietly
from runner.cli import main
sys.argv = ["runner", "run", *sys.argv[2:]]
main()
"""


def _timed(command: list[str]) -> tuple[float, float, str]:
    """(wall s, CPU s of the child, its stdout)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    began = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO, check=False, timeout=900)
    wall = time.perf_counter() - began
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"{' '.join(command[:4])} ... exited {done.returncode}:\n{done.stderr[-2000:]}")
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime), done.stdout


def _job(arm: str, data, out: str, index: int) -> tuple[float, float, float, float]:
    """(wall s, CPU s, timing.data_init_s, timing.first_step_s) of one 3-step run of the MNIST CNN under
    TensorFlow."""
    overrides = [f"data.train={data}/train-*.tfrecord", f"data.eval={data}/test-*.tfrecord", "train.epochs=1",
                 "train.steps_per_epoch=3", "accelerator.backend=tensorflow", f"output.dir={out}",
                 f"name=startup_{arm}_{index}", "output.tensorboard=false"]
    command = [sys.executable, "-c", _JOB, arm.removeprefix("job_"),
               "jobs/mnist_cnn.yaml", *[word for o in overrides for word in ("--set", o)]]
    wall, cpu_s, stdout = _timed(command)
    summary = json.loads(stdout.strip().splitlines()[-1])
    return wall, cpu_s, summary["timing"]["data_init_s"], summary["timing"]["first_step_s"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="one repetition instead of --repeat")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    repeat = 1 if args.quick else args.repeat
    data = prepared(MNIST)
    jobs = ("job_autograph", "job_plain", "job_traced_twice", "job_unfrozen")
    seen: dict[str, list[tuple[float, ...]]] = {arm: [] for arm in [*IMPORTS, *jobs]}
    with tempfile.TemporaryDirectory() as out:
        for index in range(repeat):
            for arm, code in IMPORTS.items():
                seen[arm].append(_timed([sys.executable, "-c", code])[:2])
            for arm in jobs:
                seen[arm].append(_job(arm, data, out, index))
    median = {arm: [statistics.median(column) for column in zip(*rows, strict=True)] for arm, rows in seen.items()}
    print(f"CPU: {cpu()}; {repeat} repetition(s) per arm, medians")
    print(f"{'arm':<20}{'wall s':>10}{'CPU s':>10}{'data_init_s':>14}{'first_step_s':>14}")
    for arm, values in median.items():
        extra = f"{values[2]:>14.2f}{values[3]:>14.2f}" if len(values) > 2 else ""
        print(f"{arm:<20}{values[0]:>10.2f}{values[1]:>10.2f}{extra}")
    ratios = [
        ("startup_import", median["import_runner"][0] / median["import_tensorflow"][0], "< 1",
         {"runner_s": median["import_runner"][0], "tensorflow_s": median["import_tensorflow"][0]}),
        ("startup_input_setup", median["job_plain"][2] / median["job_autograph"][2], "< 1",
         {"plain_s": median["job_plain"][2], "autograph_s": median["job_autograph"][2]}),
        ("startup_job_wall", median["job_plain"][0] / median["job_autograph"][0], "no goal",
         {"plain_s": median["job_plain"][0], "autograph_s": median["job_autograph"][0]}),
        ("startup_first_step", median["job_plain"][3] / median["job_traced_twice"][3], "< 1",
         {"built_first_s": median["job_plain"][3], "traced_twice_s": median["job_traced_twice"][3]}),
        ("startup_import_frozen_cpu", median["import_runner"][1] / median["import_unfrozen"][1], "< 1",
         {"frozen_cpu_s": median["import_runner"][1], "unfrozen_cpu_s": median["import_unfrozen"][1]}),
        ("startup_job_frozen_cpu", median["job_plain"][1] / median["job_unfrozen"][1], "< 1",
         {"frozen_cpu_s": median["job_plain"][1], "unfrozen_cpu_s": median["job_unfrozen"][1],
          "frozen_wall_s": median["job_plain"][0], "unfrozen_wall_s": median["job_unfrozen"][0]}),
    ]
    for name, ratio, goal, detail in ratios:
        print(json.dumps({"benchmark": name, "ratio": round(ratio, 3), "goal": goal,
                          "detail": {k: round(v, 2) for k, v in detail.items()} | {"cpu": cpu()}}))


if __name__ == "__main__":
    main()

"""What the summary's input wait reads when there is no input pipeline at all: its floor on this machine.

The runner's input clock (runner/observe.py) times each GetNext of the training loop. On a machine whose cores
the training step itself keeps busy, that time also holds the moments the loop's thread waits for a core,
whatever feeds it. This script trains a job's model (the runner's own build, compile and precision) on the
job's real pipeline (`data.make_dataset` on its prepared shards) and, alternating in the same process, on one
batch of that pipeline held in memory and repeated (no reading, no decoding, nothing to wait for), each behind
the same clock. A fresh model per fit; steady steps only (each fit's first epoch is left out).

    wait      real pipeline: clock wait per step, ms (what the summary reports)
    floor     one batch repeated: clock wait per step, ms (the clock's reading with no input to wait for)
    step      steady step time, ms, real and repeated

    ratio     (wait - floor) / real step time: the share of the step the pipeline itself held the loop up

    .venv/bin/python benchmarks/input_wait_floor.py [JOB ...] [--rounds N] [--epochs N] [--steps N] [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from _common import REPO

JOBS = {  # job -> the dataset folder benchmarks/input_wait.py prepares
    "mnist_cnn": "mnist",
    "fashion_mnist_cnn": "fashion_mnist",
    "weather_rnn": "weather",
}


def fit_once(spec, features, dataset, epochs: int, steps: int) -> dict[str, float]:
    import keras
    import tensorflow as tf

    from runner import models
    from runner.observe import InputClock

    class OneDevice:
        strategy = tf.distribute.get_strategy()

    clock = InputClock(OneDevice())
    keras.utils.set_random_seed(0)
    model = models.build_model(spec, features)
    models.compile_model(model, spec, "cpu")
    marks: list[tuple[float, float]] = []  # (clock seconds, wall time) at the end of each epoch

    class Marks(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            marks.append((clock.seconds(), time.perf_counter()))

    model.fit(clock.wrap(dataset), epochs=epochs, steps_per_epoch=steps, callbacks=[Marks()], verbose=0)
    (wait0, t0), (wait1, t1) = marks[0], marks[-1]
    counted = steps * (epochs - 1)
    return {"wait_ms": (wait1 - wait0) / counted * 1e3, "step_ms": (t1 - t0) / counted * 1e3}


def measure(job: str, rounds: int, epochs: int, steps: int) -> dict:
    import tensorflow as tf

    from runner import data, precision
    from runner.specfile import load_spec

    folder = REPO / "benchmarks" / "out" / JOBS[job]
    if not (folder / "manifest.json").exists():
        raise SystemExit(f"{folder} is not prepared: run benchmarks/input_wait.py {job} first")
    spec = load_spec(REPO / "jobs" / f"{job}.yaml", [f"data.train={folder}/train-*.tfrecord", "data.eval=null"])
    chosen = precision.choose(spec.train.mixed_precision, spec.model.name, "cpu")
    chosen.apply()
    d = spec.data
    shards = data.find_shards(d.train)

    def real() -> tf.data.Dataset:
        return data.make_dataset(shards, d.global_batch_size, d.inputs, d.label, training=True,
                                 shuffle_buffer=d.shuffle_buffer, seed=0)

    held = tf.data.Dataset.from_tensors(next(iter(real()))).repeat()
    results: dict[str, list[dict[str, float]]] = {"real": [], "repeated": []}
    for index in range(rounds):
        order = ("real", "repeated") if index % 2 == 0 else ("repeated", "real")
        for variant in order:
            dataset = real() if variant == "real" else held
            results[variant].append(fit_once(spec, shards.features, dataset, epochs, steps))
            row = results[variant][-1]
            print(f"{job} round {index + 1} {variant:<8}: wait {row['wait_ms']:.3f} ms/step, step {row['step_ms']:.2f} ms",
                  flush=True)
    median = {v: {k: statistics.median(r[k] for r in rows) for k in ("wait_ms", "step_ms")} for v, rows in results.items()}
    own = (median["real"]["wait_ms"] - median["repeated"]["wait_ms"]) / median["real"]["step_ms"]
    return {
        "benchmark": f"input_wait_floor[{job}]", "ratio": round(own, 4), "goal": "<= 0.02",
        "detail": {
            "wait_ms_real": round(median["real"]["wait_ms"], 3), "wait_ms_repeated": round(median["repeated"]["wait_ms"], 3),
            "step_ms_real": round(median["real"]["step_ms"], 2), "step_ms_repeated": round(median["repeated"]["step_ms"], 2),
            "reported_fraction_real": round(median["real"]["wait_ms"] / median["real"]["step_ms"], 4),
            "reported_fraction_repeated": round(median["repeated"]["wait_ms"] / median["repeated"]["step_ms"], 4),
            "batch": d.global_batch_size, "precision": chosen.policy, "rounds": rounds, "epochs": epochs, "steps": steps,
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jobs", nargs="*", metavar="JOB", help=f"one of {', '.join(JOBS)} (default: the last two)")
    parser.add_argument("--quick", action="store_true", help="1 round of 2 epochs of 20 steps")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    unknown = [job for job in args.jobs if job not in JOBS]
    if unknown:
        parser.error(f"no job {', '.join(unknown)}: choose from {', '.join(JOBS)}")
    rounds, epochs, steps = (1, 2, 20) if args.quick else (args.rounds, args.epochs, args.steps)
    rows = [measure(job, rounds, epochs, steps) for job in (args.jobs or ["fashion_mnist_cnn", "weather_rnn"])]
    print(f"\n{'job':<20}{'wait ms':>9}{'floor ms':>10}{'step ms':>9}{'reported':>10}{'pipeline own':>14}")
    for row in rows:
        d = row["detail"]
        print(f"{row['benchmark'][17:-1]:<20}{d['wait_ms_real']:>9.3f}{d['wait_ms_repeated']:>10.3f}{d['step_ms_real']:>9.2f}"
              f"{d['reported_fraction_real']:>10.4f}{row['ratio']:>14.4f}")
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()

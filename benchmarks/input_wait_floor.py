"""What the summary's input wait reads when there is no input pipeline at all: its floor on this machine.

The runner's input clock (runner/train/observe.py) times each GetNext of the training loop. On a machine whose cores
the training step itself keeps busy, that time also holds the moments the loop's thread waits for a core,
whatever feeds it. This script trains a job's model (the runner's own build, compile and precision) behind
the same clock on three inputs, alternating in one process:

    streamed  the job's shards read, parsed and batched every epoch (`data.make_dataset`, data.in_memory: false)
    held      the split loaded once, decoded, each batch gathered from it (runner/data/in_memory.py, what
              data.in_memory: auto chooses on a CPU for these jobs)
    repeated  one batch held in memory and repeated: nothing to read, decode or gather (the clock's floor)

A fresh model per fit; steady steps only (each fit's first epoch is left out). Per input: the clock's wait per
step (ms), the steady step (ms), and the reported share (wait / step, what the summary's input_wait_fraction
reads). The ratio printed per job is the held input's reported share (goal <= 0.02); `own` is the share the
pipeline adds above the floor: (wait - floor wait) / step.

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

    from runner.train import build
    from runner.train.observe import InputClock

    class OneDevice:
        strategy = tf.distribute.get_strategy()

    clock = InputClock(OneDevice())
    keras.utils.set_random_seed(0)
    model = build.build_model(spec, features)
    build.compile_model(model, spec, "cpu")
    marks: list[tuple[float, float]] = []  # (clock seconds, wall time) at the end of each epoch

    class Marks(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            marks.append((clock.seconds(), time.perf_counter()))

    model.fit(clock.wrap(dataset), epochs=epochs, steps_per_epoch=steps, callbacks=[Marks()], verbose=0)
    (wait0, t0), (wait1, t1) = marks[0], marks[-1]
    counted = steps * (epochs - 1)
    return {"wait_ms": (wait1 - wait0) / counted * 1e3, "step_ms": (t1 - t0) / counted * 1e3}


def measure(job: str, rounds: int, epochs: int, steps: int, sets: list[str]) -> dict:
    import tensorflow as tf

    from runner.data import in_memory, pipeline
    from runner.device import precision
    from runner.spec.load import load_spec

    folder = REPO / "benchmarks" / "out" / JOBS[job]
    if not (folder / "manifest.json").exists():
        raise SystemExit(f"{folder} is not prepared: run benchmarks/input_wait.py {job} first")
    spec = load_spec(REPO / "jobs" / f"{job}.yaml", [f"data.train={folder}/train-*.tfrecord", "data.eval=null", *sets])
    chosen = precision.choose(spec.train.mixed_precision, spec.model.name, "cpu")
    chosen.apply()
    d = spec.data
    shards = pipeline.find_shards(d.train)
    names = (*d.inputs, d.label)
    loaded = in_memory.load(shards, names, "data.train")

    def streamed() -> tf.data.Dataset:
        return pipeline.make_dataset(shards, d.global_batch_size, d.inputs, d.label, training=True,
                                 shuffle_buffer=d.shuffle_buffer, seed=0)

    def held() -> tf.data.Dataset:
        return in_memory.make_dataset(loaded, shards.features, d.global_batch_size, d.inputs, d.label, shuffle=True,
                                      seed=0)

    one_batch = tf.data.Dataset.from_tensors(next(iter(streamed()))).repeat()
    inputs = {"streamed": streamed, "held": held, "repeated": lambda: one_batch}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in inputs}
    for index in range(rounds):
        order = list(inputs) if index % 2 == 0 else list(reversed(inputs))
        for name in order:
            results[name].append(fit_once(spec, shards.features, inputs[name](), epochs, steps))
            row = results[name][-1]
            print(f"{job} round {index + 1} {name:<9}: wait {row['wait_ms']:.3f} ms/step, step {row['step_ms']:.2f} ms",
                  flush=True)
    median = {v: {k: statistics.median(r[k] for r in rows) for k in ("wait_ms", "step_ms")}
              for v, rows in results.items()}
    floor = median["repeated"]["wait_ms"]
    detail: dict = {}
    for name, m in median.items():
        detail[f"wait_ms_{name}"] = round(m["wait_ms"], 3)
        detail[f"step_ms_{name}"] = round(m["step_ms"], 2)
        detail[f"reported_{name}"] = round(m["wait_ms"] / m["step_ms"], 4)
        if name != "repeated":
            detail[f"own_{name}"] = round((m["wait_ms"] - floor) / m["step_ms"], 4)
    detail.update(batch=d.global_batch_size, precision=chosen.policy, rounds=rounds, epochs=epochs, steps=steps,
                  held_mb=round(in_memory.held_bytes(shards, names) / 1e6, 1), sets=" ".join(sets))
    return {"benchmark": f"input_wait_floor[{job}]", "ratio": detail["reported_held"], "goal": "<= 0.02",
            "detail": detail}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("jobs", nargs="*", metavar="JOB", help=f"one of {', '.join(JOBS)} (default: the last two)")
    parser.add_argument("--quick", action="store_true", help="1 round of 2 epochs of 20 steps")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="a spec override, e.g. train.mixed_precision=bfloat16")
    args = parser.parse_args()
    unknown = [job for job in args.jobs if job not in JOBS]
    if unknown:
        parser.error(f"no job {', '.join(unknown)}: choose from {', '.join(JOBS)}")
    rounds, epochs, steps = (1, 2, 20) if args.quick else (args.rounds, args.epochs, args.steps)
    jobs = args.jobs or ["fashion_mnist_cnn", "weather_rnn"]
    rows = [measure(job, rounds, epochs, steps, args.set) for job in jobs]
    print(f"\n{'job':<20}{'input':<10}{'wait ms':>9}{'step ms':>9}{'reported':>10}{'own':>8}")
    for row in rows:
        d = row["detail"]
        for name in ("streamed", "held", "repeated"):
            own = f"{d['own_' + name]:>8.4f}" if name != "repeated" else f"{'':>8}"
            print(f"{row['benchmark'][17:-1]:<20}{name:<10}{d['wait_ms_' + name]:>9.3f}{d['step_ms_' + name]:>9.2f}"
                  f"{d['reported_' + name]:>10.4f}{own}")
    for row in rows:
        print(json.dumps(row))


if __name__ == "__main__":
    main()

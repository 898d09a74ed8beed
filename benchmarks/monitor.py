"""Benchmark the cost of AMPMonitor (at its defaults) on `fit`'s train step.

The same MLP (Dense + LayerNorm blocks) on the same data, trained with `fit`
under `mixed_bfloat16`, with and without `AMPMonitor(log_dir)` at its
defaults, in two set-ups: with `LossScaleOptimizer.guard` (the monitor reads
the scaler's records) and with no scaler (the monitor watches the loss only).
`mixed_float16` is left out: on this CPU its steps are about 100x slower than
bfloat16 ones (no fast float16 kernels), so the monitor's fixed cost per step
would look smaller there; bfloat16 is the demanding case.

Each run is one `fit` of `1 + --epochs` epochs; the first epoch (tracing) is
not timed. The timed span, measured with the process CPU time
(`time.process_time()`, all threads) by a callback placed after the monitor,
covers every later step and all the monitor's per-step and per-epoch work
(its reads every 64 steps, TensorBoard and JSON writes, state file). Variants
run interleaved (the order rotates every repetition), each repetition
builds fresh models with the same initial weights, and the table shows the
median ms/step of `--reps` repetitions and the overhead against "without".

A third variant, "noop_batch_hook", adds a callback whose `on_train_batch_end`
does nothing: any batch-end hook switches Keras from dispatching batch-end
callbacks to a thread pool to calling them inline (with a host read of every
step's logs), and this variant shows what that switch alone costs. The monitor
has no batch-end hook (it reads as a batch begins). The monitor's own hooks
are also timed directly (host-side CPU time per step, after epoch 0), and the
compiled step alone is timed with and without the monitor's in-graph recorder
(`model.train_function` in a loop, interleaved): whole-`fit` timings on this
shared 2-core machine vary by a few percent between identical runs, these two
direct measurements do not.

Target: at most 3% overhead.

Peak memory: a fresh child process per variant (interleaved, `--rss-reps`
each) trains the same model with our `LayerNormalization` for a few steps and
reports its peak RSS (`VmHWM` of `/proc/self/status`, else
`resource.getrusage(...).ru_maxrss`, which on Linux inherits the parent's
peak across fork + exec): "layers" (our
layers alone, Keras's optimizer) against "product" (our layers, our
`LossScaleOptimizer.guard` and `AMPMonitor(log_dir)` at its defaults).

Usage: python benchmarks/monitor.py [--quick] [--jit] [--reps N] [--epochs N]
       [--steps N] [--rss-reps N] [--output PATH]
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from machine import print_header

from keras_amp_plus.callbacks import AMPMonitor
from keras_amp_plus.callbacks._step_recorder import StepRecorder
from keras_amp_plus.optimizers import LossScaleOptimizer

RESULTS = pathlib.Path(__file__).parent / "results"
TARGET_OVERHEAD = 0.03
SETUPS = ("bf16_guard", "bf16_no_scaler")
VARIANTS = ("without", "noop_batch_hook", "with_monitor")
NUM_FEATURES = 256


class NoopBatchHook(keras.callbacks.Callback):
    """Any batch-end hook turns Keras's async callback dispatch off."""

    def on_train_batch_end(self, batch, logs=None):
        pass


class EpochTimer(keras.callbacks.Callback):
    """CPU time from the start of epoch 1 to the end of the last epoch."""

    def on_epoch_begin(self, epoch, logs=None):
        if epoch == 1:
            self.start = time.process_time()

    def on_epoch_end(self, epoch, logs=None):
        self.end = time.process_time()


class TimedMonitor(AMPMonitor):
    """AMPMonitor that also sums the CPU time of its own hooks after epoch 0.

    This is the monitor's host-side cost measured directly, free of the
    run-to-run noise of whole-step timings.
    """

    host_seconds = 0.0

    def _timed(self, hook, epoch_or_batch, logs):
        start = time.process_time()
        hook(epoch_or_batch, logs)
        if self._timing:
            self.host_seconds += time.process_time() - start

    def on_epoch_begin(self, epoch, logs=None):
        self._timing = epoch >= 1
        self._timed(super().on_epoch_begin, epoch, logs)

    def on_train_batch_begin(self, batch, logs=None):
        self._timed(super().on_train_batch_begin, batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self._timed(super().on_epoch_end, epoch, logs)


def build_model(setup, width, depth, num_features, jit_compile=False):
    keras.config.set_dtype_policy("mixed_bfloat16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((num_features,))
    x = inputs
    for _ in range(depth):
        x = keras.layers.Dense(width, activation="relu")(x)
        x = keras.layers.LayerNormalization()(x)
    outputs = keras.layers.Dense(10, dtype="float32")(x)
    model = keras.Model(inputs, outputs)
    optimizer = keras.optimizers.Adam(1e-4)
    if setup == "bf16_guard":
        optimizer = LossScaleOptimizer.guard(optimizer)
    model.compile(
        optimizer, loss="sparse_categorical_crossentropy", jit_compile=jit_compile
    )
    return model


def time_run(setup, variant, dataset, args):
    model = build_model(setup, args.width, args.depth, NUM_FEATURES, args.jit)
    timer = EpochTimer()
    callbacks = [timer]
    with tempfile.TemporaryDirectory() as log_dir:
        monitor = TimedMonitor(log_dir)
        if variant == "with_monitor":
            callbacks.insert(0, monitor)
        elif variant == "noop_batch_hook":
            callbacks.insert(0, NoopBatchHook())
        model.fit(
            dataset,
            epochs=1 + args.epochs,
            steps_per_epoch=args.steps,
            verbose=0,
            callbacks=callbacks,
        )
    keras.config.set_dtype_policy("float32")
    keras.backend.clear_session()
    steps = args.epochs * args.steps
    host = 1000.0 * monitor.host_seconds / steps
    return 1000.0 * (timer.end - timer.start) / steps, host


def time_graph_step(setup, dataset, args):
    """Median ms/step of `model.train_function` called in a loop, without and
    with the monitor's in-graph recorder (no callbacks, no fit loop)."""
    model = build_model(setup, args.width, args.depth, NUM_FEATURES, args.jit)
    model.fit(dataset, epochs=1, steps_per_epoch=2, verbose=0)
    iterator = iter(dataset)
    model.make_train_function(force=True)
    functions = {"without": model.train_function}
    StepRecorder(model, 64).install()
    model.make_train_function(force=True)
    functions["with_recorder"] = model.train_function
    for function in functions.values():
        for _ in range(5):
            function(iterator)
    times = {name: [] for name in functions}
    for rep in range(args.graph_reps):
        names = list(functions) if rep % 2 == 0 else list(functions)[::-1]
        for name in names:
            start = time.process_time()
            for _ in range(args.steps):
                functions[name](iterator)
            times[name].append(1000.0 * (time.process_time() - start) / args.steps)
    keras.config.set_dtype_policy("float32")
    keras.backend.clear_session()
    # Each repetition times both functions back to back: the median of their
    # ratios cancels the slow drift of a shared machine.
    ratios = [
        r / w for r, w in zip(times["with_recorder"], times["without"], strict=True)
    ]
    return (
        statistics.median(times["without"]),
        statistics.median(times["with_recorder"]),
        statistics.median(ratios) - 1.0,
    )


RSS_CHILD = """
import os, resource, sys, tempfile
os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
import keras, numpy as np
from keras_amp_plus.callbacks import AMPMonitor
from keras_amp_plus.layers import LayerNormalization
from keras_amp_plus.optimizers import LossScaleOptimizer

variant, jit = sys.argv[1], sys.argv[2] == "1"
keras.config.set_dtype_policy("mixed_bfloat16")
keras.utils.set_random_seed(0)
inputs = keras.Input((256,))
x = inputs
for _ in range(3):
    x = keras.layers.Dense(512, activation="relu")(x)
    x = LayerNormalization()(x)
model = keras.Model(inputs, keras.layers.Dense(10, dtype="float32")(x))
optimizer = keras.optimizers.Adam(1e-4)
callbacks = []
log_dir = tempfile.mkdtemp()
if variant == "product":
    optimizer = LossScaleOptimizer.guard(optimizer)
    callbacks.append(AMPMonitor(log_dir))
model.compile(optimizer, "sparse_categorical_crossentropy", jit_compile=jit)
rng = np.random.default_rng(0)
data = rng.normal(size=(256 * 16, 256)).astype("float32")
labels = rng.integers(0, 10, size=(256 * 16,))
model.fit(data, labels, batch_size=256, epochs=2, verbose=0, callbacks=callbacks)
# Linux carries the parent's peak over fork + exec into ru_maxrss; the
# mm's own high-water mark (VmHWM) is this process's alone.
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
if os.path.exists("/proc/self/status"):
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmHWM:"):
                peak = int(line.split()[1])
print(peak)
"""


def peak_rss(reps, jit):
    """Median peak RSS (MB) of a child per variant: layers alone vs product."""
    peaks = {"layers": [], "product": []}
    root = str(pathlib.Path(__file__).resolve().parent.parent)
    env = {
        **os.environ,
        "PYTHONPATH": root + os.pathsep + os.environ.get("PYTHONPATH", ""),
    }
    for rep in range(reps):
        order = list(peaks) if rep % 2 == 0 else list(peaks)[::-1]
        for variant in order:
            done = subprocess.run(
                [sys.executable, "-c", RSS_CHILD, variant, "1" if jit else "0"],
                capture_output=True,
                text=True,
                env=env,
                check=True,
            )
            kilobytes = int(done.stdout.strip().splitlines()[-1])
            peaks[variant].append(kilobytes / 1024.0)
    return {variant: statistics.median(values) for variant, values in peaks.items()}


def rss_only(args, machine):
    """Measure and write the peak RSS of the two variants only."""
    rss = peak_rss(args.rss_reps, args.jit)
    print(
        f"peak RSS (median of {args.rss_reps} children): our layers alone "
        f"{rss['layers']:.0f} MB, full product {rss['product']:.0f} MB "
        f"({rss['product'] - rss['layers']:+.0f} MB)"
    )
    name = "monitor_rss_jit.json" if args.jit else "monitor_rss.json"
    output = pathlib.Path(args.output or RESULTS / name)
    result = {
        "benchmark": "monitor_peak_rss",
        "description": "peak RSS of a child training 2 epochs: our layers alone "
        "vs layers + LossScaleOptimizer.guard + AMPMonitor(log_dir)",
        "jit_compile": args.jit,
        "rss_reps": args.rss_reps,
        "peak_rss_mb": {k: round(v, 1) for k, v in rss.items()},
        "machine": machine,
    }
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {output}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small, fast run")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--graph-reps", type=int, default=11)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=3)
    parser.add_argument("--output", default=None)
    parser.add_argument("--jit", action="store_true", help="compile the step with XLA")
    parser.add_argument("--rss-reps", type=int, default=3)
    parser.add_argument("--rss-only", action="store_true", help="measure peak RSS only")
    args = parser.parse_args()
    if args.quick:
        args.epochs, args.steps, args.width, args.graph_reps = 2, 64, 256, 11
    name = "monitor_quick" if args.quick else "monitor"
    name += "_jit.json" if args.jit else ".json"
    explicit_output = args.output
    args.output = args.output or str(RESULTS / name)
    machine = print_header(
        f"AMPMonitor overhead on fit's train step (jit_compile={args.jit})"
    )
    if args.rss_only:
        args.output = explicit_output
        rss_only(args, machine)
        return

    rng = np.random.default_rng(0)
    samples = args.batch * args.steps
    x = rng.normal(size=(samples, NUM_FEATURES)).astype("float32")
    y = rng.integers(0, 10, size=(samples,)).astype("int32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch).repeat()

    timings = {p: {v: [] for v in VARIANTS} for p in SETUPS}
    host = {p: [] for p in SETUPS}
    for rep in range(args.reps):
        shift = rep % len(VARIANTS)
        order = VARIANTS[shift:] + VARIANTS[:shift]
        for setup in SETUPS:
            for variant in order:
                step_ms, host_ms = time_run(setup, variant, dataset, args)
                timings[setup][variant].append(step_ms)
                if variant == "with_monitor":
                    host[setup].append(host_ms)

    rows = []
    print(
        f"{'setup':16} {'variant':16} {'ms/step':>9} {'overhead':>9} "
        f"{'vs noop hook':>12}"
    )
    for setup in SETUPS:
        base = statistics.median(timings[setup]["without"])
        hook = statistics.median(timings[setup]["noop_batch_hook"])
        for variant in VARIANTS:
            median = statistics.median(timings[setup][variant])
            overhead, over_hook = median / base - 1.0, median / hook - 1.0
            rows.append(
                {
                    "setup": setup,
                    "variant": variant,
                    "median_ms_per_step": round(median, 3),
                    "overhead": round(overhead, 4),
                    "overhead_vs_noop_hook": round(over_hook, 4),
                    "runs_ms_per_step": [round(t, 3) for t in timings[setup][variant]],
                }
            )
            print(
                f"{setup:16} {variant:16} {median:9.3f} {overhead:+9.2%} "
                f"{over_hook:+12.2%}"
            )
    print("monitor hooks' own CPU time (host side), median ms/step:")
    for setup in SETUPS:
        median = statistics.median(host[setup])
        base = statistics.median(timings[setup]["without"])
        print(f"  {setup:16} {median:9.4f} ({median / base:.2%} of a step)")
    graph = {setup: time_graph_step(setup, dataset, args) for setup in SETUPS}
    print("compiled train step alone (train_function loop), median ms/step:")
    for setup, (plain, recorded, paired) in graph.items():
        print(
            f"  {setup:16} without {plain:8.3f}  with recorder {recorded:8.3f}"
            f"  {recorded / plain - 1:+.2%} (median of paired ratios {paired:+.2%})"
        )
    rss = peak_rss(args.rss_reps, args.jit)
    print(
        f"peak RSS (median of {args.rss_reps} children): our layers alone "
        f"{rss['layers']:.0f} MB, full product {rss['product']:.0f} MB "
        f"({rss['product'] - rss['layers']:+.0f} MB)"
    )
    worst = max(r["overhead"] for r in rows if r["variant"] == "with_monitor")
    verdict = "met" if worst <= TARGET_OVERHEAD else "MISSED"
    print(f"target: overhead <= {TARGET_OVERHEAD:.0%}: {verdict} (worst {worst:+.2%})")
    result = {
        "benchmark": "monitor",
        "description": "fit train-step CPU time with AMPMonitor defaults vs without",
        "settings": {
            k: getattr(args, k)
            for k in (
                "quick",
                "reps",
                "graph_reps",
                "epochs",
                "steps",
                "batch",
                "width",
                "depth",
            )
        },
        "target_overhead": TARGET_OVERHEAD,
        "worst_overhead": worst,
        "target_met": worst <= TARGET_OVERHEAD,
        "rows": rows,
        "graph_step_ms": {
            setup: {
                "without": round(p, 3),
                "with_recorder": round(r, 3),
                "paired_overhead": round(o, 4),
            }
            for setup, (p, r, o) in graph.items()
        },
        "peak_rss_mb": {k: round(v, 1) for k, v in rss.items()},
        "monitor_host_ms_per_step": {
            setup: round(statistics.median(host[setup]), 4) for setup in SETUPS
        },
        "jit_compile": args.jit,
        "machine": machine,
    }
    pathlib.Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

"""Benchmark the cost of AMPMonitor (at its defaults) on `fit`'s train step.

The same MLP (Dense + LayerNorm blocks) on the same data, trained with `fit`
under `mixed_bfloat16`, with and without `AMPMonitor(log_dir)` at its
defaults, in two set-ups: with `LossScaleOptimizer.guard` (the monitor reads
the scaler's records) and with no scaler (the monitor watches the loss only).
`mixed_float16` is left out: on this CPU its steps are about 100x slower than
bfloat16 ones (no fast float16 kernels), so the monitor's fixed cost per step
would look smaller there; bfloat16 is the demanding case.

Three measurements, each with an A/A control (the same variant run twice)
that shows the noise floor of this shared machine:

1. The compiled step alone: `model.train_function` without and with the
   monitor's in-graph recorder (and a second build without it, the control),
   called in blocks of `--block-steps` steps, interleaved in an order that
   alternates every block; the overhead is the median of the per-block
   ratios to the neighbouring "without" block.
2. The monitor's own host work, timed inside its hooks after epoch 0: per
   step (`on_train_batch_begin`, which reads the records every 64 steps) and
   per epoch (`on_epoch_begin`/`on_epoch_end`: TensorBoard and JSON writes,
   the state file). It has no batch-end hook: any batch-end hook switches
   Keras from dispatching batch-end callbacks to a thread to calling them
   inline, with a host read of every step's logs.
3. The whole `fit` step: three models with the same initial weights,
   "without", "without_again" (the control) and "with_monitor", live side
   by side and take turns, one `fit` epoch of `--steps` steps each, in an
   order that rotates every round, for `--reps` rounds after an untimed
   first epoch (tracing). An epoch is timed from its first callback to its
   last, so it includes the monitor's per-epoch work. The overhead is the
   median over rounds of the ratio to the mean of that round's two
   "without" epochs.

In 1. and 3. the control's ratio to "without" shows the noise floor.

All times are process CPU time (`time.process_time()`, all threads).
Target: at most 3% overhead per step (1. + 2.) and for the whole `fit` step.

Peak memory: a fresh child process per variant (interleaved, `--rss-reps`
each) trains the same model with our `LayerNormalization` for a few steps and
reports its peak RSS (`VmHWM` of `/proc/self/status`, else
`resource.getrusage(...).ru_maxrss`, which on Linux inherits the parent's
peak across fork + exec): "layers" (our layers alone, Keras's optimizer)
against "product" (our layers, our `LossScaleOptimizer.guard` and
`AMPMonitor(log_dir)` at its defaults).

Usage: python benchmarks/monitor.py [--quick] [--jit] [--reps N] [--steps N]
       [--blocks N] [--rss-reps N] [--output PATH]
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
VARIANTS = ("without", "without_again", "with_monitor")
NUM_FEATURES = 256


class EpochStart(keras.callbacks.Callback):
    """First in the list: the process CPU time when an epoch begins."""

    def on_epoch_begin(self, epoch, logs=None):
        self.start = time.process_time()


class EpochEnd(keras.callbacks.Callback):
    """Last in the list: the CPU seconds of each epoch, hooks included."""

    def __init__(self, start):
        super().__init__()
        self.start = start
        self.seconds = []

    def on_epoch_end(self, epoch, logs=None):
        self.seconds.append(time.process_time() - self.start.start)


class TimedMonitor(AMPMonitor):
    """AMPMonitor that also sums the CPU time of its own hooks once `timing`.

    Per-step (`on_train_batch_begin`) and per-epoch hooks are summed apart:
    the first is paid on every step, the second once an epoch.
    """

    step_seconds = 0.0
    epoch_seconds = 0.0
    timing = False

    def _timed(self, kind, hook, epoch_or_batch, logs):
        start = time.process_time()
        hook(epoch_or_batch, logs)
        if self.timing:
            spent = time.process_time() - start
            setattr(self, kind, getattr(self, kind) + spent)

    def on_epoch_begin(self, epoch, logs=None):
        self._timed("epoch_seconds", super().on_epoch_begin, epoch, logs)

    def on_train_batch_begin(self, batch, logs=None):
        self._timed("step_seconds", super().on_train_batch_begin, batch, logs)

    def on_epoch_end(self, epoch, logs=None):
        self._timed("epoch_seconds", super().on_epoch_end, epoch, logs)


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


class FitVariant:
    """One model of one variant, trained one `fit` epoch at a time."""

    def __init__(self, setup, variant, dataset, args, log_dir):
        self.model = build_model(setup, args.width, args.depth, NUM_FEATURES, args.jit)
        self.dataset, self.steps = dataset, args.steps
        start = EpochStart()
        self.end = EpochEnd(start)
        self.monitor = TimedMonitor(log_dir) if variant == "with_monitor" else None
        self.callbacks = [start, *([self.monitor] if self.monitor else []), self.end]

    def epoch(self):
        """Run one epoch; return its CPU ms per step."""
        self.model.fit(
            self.dataset,
            epochs=1,
            steps_per_epoch=self.steps,
            verbose=0,
            callbacks=self.callbacks,
        )
        return 1000.0 * self.end.seconds[-1] / self.steps


def paired(values, reference):
    """Median and quartiles of `values[i] / reference[i] - 1`."""
    ratios = sorted(v / r - 1.0 for v, r in zip(values, reference, strict=True))
    quartiles = statistics.quantiles(ratios, n=4) if len(ratios) > 1 else ratios * 3
    return {
        "median": round(statistics.median(ratios), 4),
        "q1": round(quartiles[0], 4),
        "q3": round(quartiles[-1], 4),
    }


def both_without(times):
    """Per block or round: the mean of the "without" and "without_again" times."""
    pairs = zip(times["without"], times["without_again"], strict=True)
    return [(a + b) / 2.0 for a, b in pairs]


def time_graph_step(setup, dataset, args):
    """Time `model.train_function` without/with the recorder, in blocks.

    Returns the median ms/step of each function, the paired overhead of
    "with_recorder" against the mean of both "without" builds, and the
    control: "without_again" against "without".
    """
    model = build_model(setup, args.width, args.depth, NUM_FEATURES, args.jit)
    model.fit(dataset, epochs=1, steps_per_epoch=2, verbose=0)
    iterator = iter(dataset)
    functions = {}
    for name in ("without", "without_again"):
        model.make_train_function(force=True)
        functions[name] = model.train_function
    StepRecorder(model, 64).install()
    model.make_train_function(force=True)
    functions["with_recorder"] = model.train_function
    for function in functions.values():
        for _ in range(5):
            function(iterator)
    times = {name: [] for name in functions}
    names = list(functions)
    for block in range(args.blocks):
        shift = block % len(names)
        for name in names[shift:] + names[:shift]:
            start = time.process_time()
            for _ in range(args.block_steps):
                functions[name](iterator)
            spent = time.process_time() - start
            times[name].append(1000.0 * spent / args.block_steps)
    keras.config.set_dtype_policy("float32")
    keras.backend.clear_session()
    return {
        "ms_per_step": {n: round(statistics.median(t), 3) for n, t in times.items()},
        "with_recorder": paired(times["with_recorder"], both_without(times)),
        "without_again": paired(times["without_again"], times["without"]),
    }


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


def run_fits(dataset, args):
    """Whole-`fit` timings: {setup: {variant: [ms/step]}} and monitor host costs.

    The models of a set-up live side by side and take turns, one `fit` epoch
    each, in an order that rotates every round: the machine's drift and the
    process's growth weigh on all of them alike. The first epoch of each
    (tracing, XLA compilation) is not timed.
    """
    timings = {p: {v: [] for v in VARIANTS} for p in SETUPS}
    host = {}
    for setup in SETUPS:
        with tempfile.TemporaryDirectory() as log_dir:
            variants = {
                name: FitVariant(setup, name, dataset, args, log_dir)
                for name in VARIANTS
            }
            for variant in variants.values():
                variant.epoch()
            monitor = variants["with_monitor"].monitor
            monitor.timing = True
            for rnd in range(args.reps):
                shift = rnd % len(VARIANTS)
                for name in VARIANTS[shift:] + VARIANTS[:shift]:
                    timings[setup][name].append(variants[name].epoch())
            steps = args.reps * args.steps
            host[setup] = {
                "per_step_ms": round(1000.0 * monitor.step_seconds / steps, 4),
                "per_epoch_ms": round(1000.0 * monitor.epoch_seconds / args.reps, 2),
            }
        keras.config.set_dtype_policy("float32")
        keras.backend.clear_session()
    return timings, host


def summarize_fits(timings, host):
    """Print the whole-fit table; return its rows (JSON)."""
    rows = []
    print(f"{'setup':16} {'variant':16} {'ms/step':>9} {'overhead [q1, q3]':>24}")
    for setup in SETUPS:
        for variant in VARIANTS:
            values = timings[setup][variant]
            base = timings[setup]["without"]
            if variant == "with_monitor":
                base = both_without(timings[setup])
            overhead = paired(values, base)
            rows.append(
                {
                    "setup": setup,
                    "variant": variant,
                    "median_ms_per_step": round(statistics.median(values), 3),
                    "paired_overhead": overhead,
                    "runs_ms_per_step": [round(t, 3) for t in values],
                }
            )
            print(
                f"{setup:16} {variant:16} {statistics.median(values):9.3f} "
                f"{overhead['median']:+10.2%} [{overhead['q1']:+.2%}, "
                f"{overhead['q3']:+.2%}]"
            )
    print("monitor hooks' own CPU time (host side), medians:")
    for setup in SETUPS:
        step = host[setup]["per_step_ms"]
        epoch = host[setup]["per_epoch_ms"]
        base = statistics.median(timings[setup]["without"])
        print(
            f"  {setup:16} per step {step:.4f} ms ({step / base:.2%} of a step), "
            f"per epoch {epoch:.1f} ms"
        )
    return rows


def summarize_graph(graph):
    print("compiled train step alone, blocks of steps, median ms/step:")
    for setup, result in graph.items():
        ms = result["ms_per_step"]
        rec, aa = result["with_recorder"], result["without_again"]
        print(
            f"  {setup:16} without {ms['without']:7.3f}  with recorder "
            f"{ms['with_recorder']:7.3f}: {rec['median']:+.2%} "
            f"[{rec['q1']:+.2%}, {rec['q3']:+.2%}]; control (without, again) "
            f"{aa['median']:+.2%} [{aa['q1']:+.2%}, {aa['q3']:+.2%}]"
        )


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small, fast run")
    parser.add_argument("--reps", type=int, default=15, help="rounds of epochs")
    parser.add_argument("--blocks", type=int, default=90)
    parser.add_argument("--block-steps", type=int, default=16)
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
        args.reps, args.steps, args.width, args.blocks = 9, 64, 256, 45
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

    graph = {setup: time_graph_step(setup, dataset, args) for setup in SETUPS}
    summarize_graph(graph)
    timings, host = run_fits(dataset, args)
    rows = summarize_fits(timings, host)
    rss = peak_rss(args.rss_reps, args.jit)
    print(
        f"peak RSS (median of {args.rss_reps} children): our layers alone "
        f"{rss['layers']:.0f} MB, full product {rss['product']:.0f} MB "
        f"({rss['product'] - rss['layers']:+.0f} MB)"
    )
    host_medians = host
    per_step = {
        setup: graph[setup]["with_recorder"]["median"]
        + host_medians[setup]["per_step_ms"]
        / statistics.median(timings[setup]["without"])
        for setup in SETUPS
    }
    whole = {
        row["setup"]: row["paired_overhead"]["median"]
        for row in rows
        if row["variant"] == "with_monitor"
    }
    worst = max(max(per_step.values()), max(whole.values()))
    verdict = "met" if worst <= TARGET_OVERHEAD else "MISSED"
    print(
        "per-step overhead (compiled step + per-step hooks): "
        + ", ".join(f"{k} {v:+.2%}" for k, v in per_step.items())
    )
    print(f"target: overhead <= {TARGET_OVERHEAD:.0%}: {verdict} (worst {worst:+.2%})")
    result = {
        "benchmark": "monitor",
        "description": "train-step CPU time with AMPMonitor defaults vs without, "
        "paired ratios with an A/A control",
        "settings": {
            k: getattr(args, k)
            for k in (
                "quick",
                "reps",
                "blocks",
                "block_steps",
                "steps",
                "batch",
                "width",
                "depth",
            )
        },
        "target_overhead": TARGET_OVERHEAD,
        "per_step_overhead": {k: round(v, 4) for k, v in per_step.items()},
        "whole_fit_overhead": whole,
        "worst_overhead": round(worst, 4),
        "target_met": worst <= TARGET_OVERHEAD,
        "compiled_step": graph,
        "fit_rows": rows,
        "monitor_host": host_medians,
        "peak_rss_mb": {k: round(v, 1) for k, v in rss.items()},
        "jit_compile": args.jit,
        "machine": machine,
    }
    pathlib.Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()

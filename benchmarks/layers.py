"""Benchmark keras_amp_plus.layers against Keras's layers over a shape grid.

For each layer, policy (`float32`, `mixed_bfloat16`, `mixed_float16`), step
kind and shape of a grid of shapes real models use:

- LayerNormalization vs `keras.layers.LayerNormalization`, rows x features
  from 512 x 256 to 16384 x 1024 (batch x sequence flattened), fed as a
  transformer feeds it: (rows / 128, 128, features) (`--sequence`; 0 feeds
  the 2-D rows);
- InstanceNormalization vs `keras.layers.GroupNormalization(groups=-1)`,
  NHWC from 8 x 16 x 16 x 32 to 32 x 64 x 64 x 128;
- Swish vs `keras.layers.Activation("swish")`, 0.5M to 32M elements, rows x
  features fed as sequences too (a transformer's feed-forward activations);

one forward + backward step (gradients w.r.t. the input and every weight,
upstream gradient given) is wrapped in a `tf.function` ("graph" step), in one
traced for any batch size ("tfdata" step: the batch axis unknown when traced,
as `fit` traces a `tf.data` pipeline without `drop_remainder` or data with a
partial last batch), in one traced with every axis but the last unknown
("any_size": a fully convolutional model, `keras.Input((None, None, C))`,
or sequences of any length), in a `tf.function(jit_compile=True)` ("xla" step: the
layer inlined into one XLA cluster, as in a model compiled with
`jit_compile=True`) and in one traced for any batch size too ("xla_tfdata":
as `fit(jit_compile=True)` traces such a pipeline; XLA then compiles the
shape it is called with). Ours and Keras's steps are called interleaved, call
by call, in an order shuffled each round, after a warm-up; each figure is the
median process CPU time (`time.process_time()`, all threads) of `--reps`
calls (more for cheap cells, see `MIN_CELL_SECONDS`), so load from other
processes on a shared machine inflates it little.
The ratio is ours / Keras's: below 1 is faster. Outputs are checked against
Keras's (same weights) before timing.

Before timing, the layers' graph-step path choice, Swish's sigmoid
threshold and instance norm's sums inside XLA are measured as the doctor
measures them (`keras_amp_plus.layers._path_calibration`,
`_swish_calibration`, `_xla_sums_calibration`), into a
temporary cache directory so the user's cache is left alone;
`--no-calibrate` reads the user's cache (the rule and the table where
nothing is cached). The measured cells (graph-step paths, XLA sums) go into
the JSON.

`--control` adds an A/A control to every cell: a second Keras layer (same
weights, its own function) timed in the same rounds; its ratio to Keras's shows
how far a ratio moves when nothing differs.

`--floor` adds a reference for what the layer's inputs and outputs cost:
`AffineFloor`, a float32 per-channel scale and shift (Swish: a float32
multiply) with the same inputs, outputs and weight gradients as the layer
but no statistics, written plainly. In XLA steps it is fused with nothing
else, as the layer is; in graph steps it is the lower of its two forms,
plain TensorFlow ops (as Keras's formula and the batch-norm paths run) and
one XLA kernel per pass (as the fused kernels run), each timed in the same
rounds. It is not a lower bound: a layer whose sums are cheaper than the
affine's weight-gradient reductions runs below it (the layer-norm kernels
do, their sums being matrix products).

The header names the CPU and its bfloat16 features; the JSON written to
`benchmarks/results/` (named per CPU kind) carries them with every cell.

Usage: python benchmarks/layers.py [--quick] [--reps N] [--policies ...]
    [--steps graph xla] [--layers LN IN Swish] [--sequence N]
    [--no-calibrate] [--control]
    [--floor] [--output PATH]
"""

import argparse
import json
import math
import os
import pathlib
import random
import statistics
import sys
import tempfile
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from machine import RESULTS, cpu_kind, print_header

from keras_amp_plus import layers
from keras_amp_plus.layers import (
    _path_calibration,
    _swish_activation,
    _swish_calibration,
    _xla_sums_calibration,
)

POLICIES = ("mixed_bfloat16", "mixed_float16", "float32")
STEPS = ("graph", "tfdata", "any_size", "xla", "xla_tfdata")
ANY_BATCH_STEPS = ("tfdata", "xla_tfdata")
XLA_STEPS = ("xla", "xla_tfdata")
TARGET_WORST, TARGET_MEDIAN = 1.0, 0.6
# Calls per implementation and cell: at least --reps, more for cheap cells
# until one implementation has run MIN_CELL_SECONDS of CPU time, at most
# MAX_REPS (the default grid then runs in under 10 minutes on 2 loaded cores).
MIN_CELL_SECONDS, MAX_REPS = 0.4, 25

GRID = {
    "LN": [
        (512, 256),
        (2048, 256),
        (8192, 256),
        (16384, 256),
        (1024, 512),
        (4096, 512),
        (512, 1024),
        (2048, 1024),
        (3072, 1024),
        (8192, 1024),
        (16384, 1024),
    ],
    "IN": [
        (8, 16, 16, 32),
        (16, 16, 16, 64),
        (8, 32, 32, 64),
        (8, 64, 64, 32),
        (16, 32, 32, 64),
        (8, 64, 64, 64),
        (32, 32, 32, 128),
        (32, 64, 64, 128),
    ],
    "Swish": [(512, 1024), (1024, 2048), (2048, 2048), (4096, 2048), (8192, 4096)],
}
QUICK_GRID = {
    "LN": [(512, 256), (3072, 1024)],
    "IN": [(8, 16, 16, 32), (8, 64, 64, 32)],
    "Swish": [(512, 1024), (2048, 2048)],
}


def fed_shape(kind, shape, sequence):
    """Return the input shape of a cell: rows x features split into sequences."""
    rows, features = shape if kind in ("LN", "Swish") else (None, None)
    if not sequence or rows is None or rows % sequence:
        return tuple(shape)
    return (rows // sequence, sequence, features)


def layer_pair(kind):
    """Return (ours, Keras's) fresh layers of `kind`."""
    if kind == "LN":
        return layers.LayerNormalization(), keras.layers.LayerNormalization()
    if kind == "IN":
        return (
            layers.InstanceNormalization(),
            keras.layers.GroupNormalization(groups=-1),
        )
    return layers.Swish(), keras.layers.Activation("swish")


class AffineFloor(keras.layers.Layer):
    """Float32 `x * gamma + beta` over the last axis (`kind` "Swish": `x * 2`).

    `kernels=True` runs each pass as one XLA kernel, as the layers' fused
    kernels do (in XLA steps both forms are the same program).
    """

    def __init__(self, kind, kernels=False, **kwargs):
        super().__init__(**kwargs)
        self.kind = kind
        self.kernels = kernels

    def build(self, input_shape):
        if self.kind != "Swish":
            self.gamma = self.add_weight(shape=input_shape[-1:], initializer="ones")
            self.beta = self.add_weight(shape=input_shape[-1:], initializer="zeros")

    def call(self, inputs):
        if self.kind == "Swish":
            gamma, beta = tf.constant(2.0), tf.constant(0.0)
        else:
            gamma = keras.ops.cast(self.gamma, "float32")
            beta = keras.ops.cast(self.beta, "float32")
        if not self.kernels:
            return _affine(inputs, gamma, beta)
        weight_grads = self.kind != "Swish"
        return _affine_in_kernels(inputs, gamma, beta, weight_grads)


def _affine(x, gamma, beta):
    return tf.cast(tf.cast(x, tf.float32) * gamma + beta, x.dtype)


@tf.function(jit_compile=True)
def _affine_forward(x, gamma, beta):
    return _affine(x, gamma, beta)


@tf.function(jit_compile=True)
def _affine_backward(upstream, x, gamma, weight_grads):
    wide = tf.cast(upstream, tf.float32)
    x_grad = tf.cast(wide * gamma, x.dtype)
    if not weight_grads:
        return x_grad, tf.zeros_like(gamma), tf.zeros_like(gamma)
    axes = list(range(x.shape.rank - 1))
    gamma_grad = tf.reduce_sum(wide * tf.cast(x, tf.float32), axes)
    return x_grad, gamma_grad, tf.reduce_sum(wide, axes)


def _affine_in_kernels(x, gamma, beta, weight_grads):
    @tf.custom_gradient
    def affine(x, gamma, beta):
        def grad(upstream):
            return _affine_backward(upstream, x, gamma, weight_grads)

        return _affine_forward(x, gamma, beta), grad

    return affine(x, gamma, beta)


def make_step(layer, step_kind, shape, dtype):
    """Return a tf.function running forward + backward through `layer`."""
    signature = None
    if step_kind in ANY_BATCH_STEPS:
        spec = tf.TensorSpec((None, *shape[1:]), dtype)
        signature = [spec, spec]
    elif step_kind == "any_size":  # all but the last axis unknown
        spec = tf.TensorSpec((None,) * (len(shape) - 1) + shape[-1:], dtype)
        signature = [spec, spec]

    @tf.function(jit_compile=step_kind in XLA_STEPS, input_signature=signature)
    def step(x, upstream):
        with tf.GradientTape() as tape:
            tape.watch(x)
            outputs = layer(x)
        sources = [x, *layer.trainable_weights]
        return outputs, tape.gradient(outputs, sources, output_gradients=upstream)

    return step


def build_pair(kind, shape, policy):
    """Return (ours, keras, keras again) built for `shape`, all with one weights."""
    ours, theirs = layer_pair(kind)
    again = layer_pair(kind)[1]
    for layer in (ours, theirs, again):
        layer.build(shape)
    rng = np.random.default_rng(3)
    values = [rng.normal(1.0 - i, 0.3, w.shape) for i, w in enumerate(ours.weights)]
    for weight, value in zip(ours.weights, values, strict=True):
        weight.assign(value)
    theirs.set_weights(ours.get_weights())
    again.set_weights(ours.get_weights())
    return ours, theirs, again


def inputs_for(shape, dtype, seed=0):
    rng = np.random.default_rng(seed)
    x = tf.cast(tf.constant(rng.normal(0.5, 1.0, shape), tf.float32), dtype)
    upstream = tf.cast(tf.constant(rng.normal(0.0, 1.0, shape), tf.float32), dtype)
    return x, upstream


def check_close(ours_out, keras_out, dtype):
    """Raise if ours and Keras's outputs differ beyond the dtype's rounding."""
    tolerance = {"float32": 1e-3, "float16": 5e-2, "bfloat16": 1.5e-1}[dtype]
    a = np.asarray(tf.cast(ours_out, tf.float32))
    b = np.asarray(tf.cast(keras_out, tf.float32))
    error = float(np.abs(a - b).max())
    if not error <= tolerance:
        raise RuntimeError(f"ours and Keras's outputs differ by {error}")
    return error


def time_interleaved(steps, args, reps, max_reps=None):
    """Return ({name: median ms}, reps) of `steps(*args)`, called interleaved.

    Each round calls every step once, in an order shuffled per round (seeded):
    in a fixed order the step after another one ran up to 10% slower or
    faster than the same step elsewhere in the round on a shared 2-core
    machine, a bias an A/A control in another position does not show.
    Small cells are the noisiest: each gets at least MIN_CELL_SECONDS of
    the slowest step, at most `max_reps` rounds (default MAX_REPS).
    """
    warm = []
    for step in steps.values():
        start = time.process_time()
        step(*args)
        warm.append(time.process_time() - start)
    reps = max(reps, math.ceil(MIN_CELL_SECONDS / max(warm)))
    reps = min(reps, MAX_REPS if max_reps is None else max_reps)
    order = list(steps)
    shuffle = random.Random(0).shuffle
    times = {name: [] for name in steps}
    for _ in range(reps):
        shuffle(order)
        for name in order:
            start = time.process_time()
            steps[name](*args)
            times[name].append(time.process_time() - start)
    return {name: 1e3 * statistics.median(t) for name, t in times.items()}, reps


def time_cell(
    kind, cell, policy, step_kind, reps, floor=False, control=False, sequence=0
):
    """Return one grid cell: median ms of ours and Keras's, and their ratio."""
    shape = fed_shape(kind, cell, sequence)
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        ours, theirs, again = build_pair(kind, shape, policy)
        dtype = keras.config.dtype_policy().compute_dtype
        floors = {"floor": AffineFloor(kind)}
        if step_kind not in XLA_STEPS:
            floors["floor_kernels"] = AffineFloor(kind, kernels=True)
        for floor_layer in floors.values():
            floor_layer.build(shape)
    finally:
        keras.config.set_dtype_policy(previous)
    x, upstream = inputs_for(shape, dtype)
    steps = {
        who: make_step(layer, step_kind, shape, dtype)
        for who, layer in (("ours", ours), ("keras", theirs))
    }
    outputs = {who: step(x, upstream)[0] for who, step in steps.items()}
    error = check_close(outputs["ours"], outputs["keras"], dtype)
    if floor:
        for name, floor_layer in floors.items():
            steps[name] = make_step(floor_layer, step_kind, shape, dtype)
            steps[name](x, upstream)
    if control:
        steps["keras_again"] = make_step(again, step_kind, shape, dtype)
        steps["keras_again"](x, upstream)
    medians, reps = time_interleaved(steps, (x, upstream), reps)
    ours_ms, keras_ms = medians["ours"], medians["keras"]
    floor_cells = {}
    if "floor" in medians:
        floor_ms = min(medians["floor"], medians.get("floor_kernels", math.inf))
        floor_cells = {"floor_ms": floor_ms, "floor_ratio": floor_ms / keras_ms}
        if "floor_kernels" in medians:
            floor_cells["floor_ops_ms"] = medians["floor"]
            floor_cells["floor_kernels_ms"] = medians["floor_kernels"]
    if "keras_again" in medians:
        floor_cells["control_ratio"] = medians["keras_again"] / keras_ms
    return {
        **floor_cells,
        "layer": kind,
        "shape": list(cell),
        "input_shape": list(shape),
        "elements": int(np.prod(shape)),
        "policy": policy,
        "step": step_kind,
        "ours_ms": ours_ms,
        "keras_ms": keras_ms,
        "ratio": ours_ms / keras_ms,
        "max_output_difference": error,
        "reps": reps,
    }


ALL_POLICIES = "all policies"


def summarize(rows):
    """Return {(layer, step, policy): (worst, median, worst shape, floor, A/A)}.

    Per policy, and over the whole grid of a layer and step (`ALL_POLICIES`),
    as the targets read.
    """
    groups = {}
    for row in rows:
        for policy in (row["policy"], ALL_POLICIES):
            groups.setdefault((row["layer"], row["step"], policy), []).append(row)
    summary = {}
    for key, group in groups.items():
        worst = max(group, key=lambda r: r["ratio"])
        floors = [r["floor_ratio"] for r in group if "floor_ratio" in r]
        controls = [r["control_ratio"] for r in group if "control_ratio" in r]
        summary[key] = (
            worst["ratio"],
            statistics.median(r["ratio"] for r in group),
            tuple(worst["shape"]),
            statistics.median(floors) if floors else None,
            max(controls) if controls else None,
        )
    return summary


def print_summary(summary):
    print(
        f"\n{'layer':<6} {'step':<10} {'policy':<15} {'worst':>6} {'median':>7} "
        f"{'floor':>6} {'A/A':>5}  at"
    )
    for key, (worst, median, shape, floor, control) in sorted(summary.items()):
        kind, step, policy = key
        flag = "" if worst <= TARGET_WORST and median <= TARGET_MEDIAN else "  *"
        floor_text = "" if floor is None else f"{floor:.2f}"
        control_text = "" if control is None else f"{control:.2f}"
        print(
            f"{kind:<6} {step:<10} {policy:<15} {worst:6.2f} {median:7.2f} "
            f"{floor_text:>6} {control_text:>5}  {shape}{flag}"
        )
    print(
        f"(* misses the target: worst <= {TARGET_WORST}, median <= {TARGET_MEDIAN};"
        " ratio = ours / Keras's CPU time, forward + backward; floor = median"
        " of AffineFloor / Keras's, an affine layer with the same inputs and"
        " outputs and no statistics (a reference, not a bound);"
        " A/A = worst ratio of a second Keras layer to Keras's, the noise)"
    )


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 shapes per layer")
    parser.add_argument("--reps", type=int, default=None, help="minimum, default 3")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS)
    parser.add_argument("--layers", nargs="+", default=list(GRID), choices=GRID)
    parser.add_argument(
        "--no-calibrate",
        action="store_true",
        help="skip measuring the paths and Swish's threshold (read the user's cache)",
    )
    parser.add_argument(
        "--floor", action="store_true", help="also time AffineFloor (the floor)"
    )
    parser.add_argument(
        "--control", action="store_true", help="also time Keras's layer again (A/A)"
    )
    parser.add_argument(
        "--sequence",
        type=int,
        default=128,
        help="feed layer norm (rows/N, N, features); 0: (rows, features)",
    )
    parser.add_argument("--output", type=pathlib.Path, default=None)
    return parser.parse_args()


def calibrate(quick):
    """Measure what the doctor measures into a fresh cache directory.

    The graph-step paths, Swish's sigmoid threshold and instance
    norm's sums inside XLA, as `python -m keras_amp_plus doctor` races them
    for the layers. Returns `(graph-step path cells, XLA sums cells)`.
    """
    os.environ["KERAS_AMP_PLUS_CACHE_DIR"] = tempfile.mkdtemp(prefix="kap_paths_")
    raced = list(_swish_activation.sigmoid_thresholds())
    _swish_calibration.measure_recompute(raced, seconds=8.0 if quick else 32.0)
    print(
        f"measured Swish's sigmoid thresholds: {_swish_activation.sigmoid_thresholds()}"
    )
    sums = _xla_sums_calibration.measure_sums(seconds=8.0 if quick else 30.0)
    products = ", ".join(
        f"{cell['dtype']} {cell['shape']} {cell['ratio']:.2f}" for cell in sums["cells"]
    )
    print(f"measured instance norm's products / formula inside XLA: {products}")
    result = _path_calibration.measure_paths(
        seconds=20.0 if quick else 80.0, reps=3 if quick else 11
    )
    print("measured graph-step paths (CPU time / Keras's formula's):")
    for cell in result["cells"]:
        ratios = ", ".join(f"{k} {v:.2f}" for k, v in cell["ratios"].items())
        batch = "any batch" if cell["unknown_batch"] else "its batch"
        print(
            f"  {cell['dtype']:<9} {cell['shape']!s:<18} {batch:<9} {ratios}"
            f" -> {cell['path']}"
        )
    return result["cells"], sums["cells"]


def main():
    args = parse_args()
    reps = args.reps or 3
    info = print_header("Layers vs Keras's, forward + backward, CPU time ratio")
    kind_tag = cpu_kind(info)
    suffix = "_quick" if args.quick else ""
    output = args.output or RESULTS / f"layers_{kind_tag}{suffix}.json"
    grid = QUICK_GRID if args.quick else GRID
    start = time.time()
    calibration, xla_sums = (None, None) if args.no_calibrate else calibrate(args.quick)
    rows = []
    print(
        f"\n{'layer':<6} {'shape':<20} {'policy':<15} {'step':<10} "
        f"{'ours ms':>8} {'keras ms':>9} {'ratio':>6}"
    )
    for kind in args.layers:
        for shape in grid[kind]:
            for policy in args.policies:
                for step_kind in args.steps:
                    row = time_cell(
                        kind,
                        shape,
                        policy,
                        step_kind,
                        reps,
                        args.floor,
                        args.control,
                        args.sequence,
                    )
                    floor = row.get("floor_ratio")
                    control = row.get("control_ratio")
                    rows.append(row)
                    print(
                        f"{kind:<6} {shape!s:<20} {policy:<15} {step_kind:<10} "
                        f"{row['ours_ms']:8.2f} {row['keras_ms']:9.2f} "
                        f"{row['ratio']:6.2f}"
                        + ("" if floor is None else f"  floor {floor:.2f}")
                        + ("" if control is None else f"  A/A {control:.2f}"),
                        flush=True,
                    )
    summary = summarize(rows)
    print_summary(summary)
    print(f"wall time {time.time() - start:.0f} s")
    output.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "cpu": info,
        "cpu_kind": kind_tag,
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "reps": reps,
        "quick": args.quick,
        "sequence": args.sequence,
        "command": " ".join(["python", *sys.argv]),
        "TF_ENABLE_ONEDNN_OPTS": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
        "path_calibration": calibration,
        "xla_sums_calibration": xla_sums,
    }
    table = [
        {
            "layer": k,
            "step": s,
            "policy": p,
            "worst": w,
            "median": m,
            "worst_at": a,
            "floor_median": f,
            "control_worst": c,
        }
        for (k, s, p), (w, m, a, f, c) in sorted(summary.items())
    ]
    output.write_text(
        json.dumps({"meta": meta, "summary": table, "rows": rows}, indent=2) + "\n"
    )
    print(f"wrote {output}")


if __name__ == "__main__":
    main()

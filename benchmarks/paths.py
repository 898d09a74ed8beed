"""Time each normalization path against Keras's layer over the layers' grid.

The layers choose among implementations per shape in a graph step
(`keras_amp_plus.layers._path_choice`): the fused XLA kernels, Keras's own
formula with float32 statistics and, for instance norm, TensorFlow's fused
batch-norm kernel on the transposed batch or one sample at a time.
`benchmarks/layers.py` times the choice; this script times every path on
its own (forced with `KERAS_AMP_PLUS_NORMALIZATION_PATH` while the step is
traced), beside Keras's layer and a second Keras layer (A/A
control), in the graph steps of `layers.py` ("graph": the batch size known
when traced; "tfdata": traced for any batch size), called interleaved, call
by call in an order shuffled each round, median process CPU time. It is the
evidence behind the rules a measurement does not decide (float16 instance
norms without float16 arithmetic, for one) and shows which path a CPU should
take where. For float16 instance norms it also times TensorFlow's
batch-norm kernel in float16 (`batch_norm_float16_kernel`,
`per_sample_batch_norm_float16_kernel`) beside the paths as the layer runs
them, which on a CPU without float16 arithmetic widen to the float32 kernel
(`_precision.kernel_dtype`; the XLA kernels there read the input widened by
TensorFlow's `Cast` too, `_fused_normalization._kernels_input`), and the
kernels and Keras's formula in a float32 layer between two casts
(`fused_kernels_widened`, `keras_formula_widened`), the widening done before
the layer instead of inside it.

The header names the CPU; the JSON written to `benchmarks/results/` (named per
CPU kind) carries it with every cell.

Usage: python benchmarks/paths.py [--layers IN LN] [--policies ...]
    [--steps graph tfdata] [--reps N] [--quick] [--shapes 8x64x64x64 ...]
    [--output PATH]
"""

import argparse
import math
import os
import pathlib
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import tensorflow as tf
from layers import (
    GRID,
    POLICIES,
    QUICK_GRID,
    RESULTS,
    build_pair,
    check_close,
    fed_shape,
    inputs_for,
    layer_pair,
    make_step,
    time_interleaved,
)
from machine import cpu_kind, print_header, write_results

from keras_amp_plus.layers import _path_choice, _per_sample_batch_norm, _precision

STEPS = ("graph", "tfdata")
# The batch-norm paths with the kernel in float16, as CPUs with float16
# arithmetic run them (float16 inputs only; suffix of the path's name).
FLOAT16_KERNEL = "_float16_kernel"
# The kernels and Keras's formula in a float32 layer between two casts: the
# float16 input widened before the layer rather than inside it (float16
# inputs only; suffix).
WIDENED = "_widened"
WIDENED_PATHS = (_path_choice.FUSED_KERNELS, _path_choice.KERAS_FORMULA)
PATHS = {
    "IN": (
        _path_choice.KERAS_FORMULA,
        _path_choice.FUSED_KERNELS,
        _path_choice.BATCH_NORM,
        _path_choice.PER_SAMPLE_BATCH_NORM,
    ),
    "LN": (_path_choice.KERAS_FORMULA, _path_choice.FUSED_KERNELS),
}


def applicable_paths(kind, shape, dtype):
    """Return the paths of `kind` that can run at `shape` (none falls back)."""
    sample_elements = math.prod(shape[1:])
    small = sample_elements < _per_sample_batch_norm.MIN_SAMPLE_ELEMENTS
    per_sample = _path_choice.PER_SAMPLE_BATCH_NORM
    paths = [path for path in PATHS[kind] if not (path == per_sample and small)]
    batch_norm_paths = (_path_choice.BATCH_NORM, per_sample)
    if dtype == "float16":
        paths += [p + FLOAT16_KERNEL for p in paths if p in batch_norm_paths]
        paths += [p + WIDENED for p in paths if p in WIDENED_PATHS]
    return paths


class Widened(keras.layers.Layer):
    """A float32 layer between two casts: float16 in, float32 inside, float16 out."""

    def __init__(self, inner):
        super().__init__(dtype="float32", autocast=False)
        self.inner = inner

    def call(self, inputs):
        return tf.cast(self.inner(tf.cast(inputs, tf.float32)), inputs.dtype)


def forced_layer(kind, path, shape, weights):
    """Return a fresh layer of ours for `path` (`WIDENED`: wrapped, float32)."""
    if not path.endswith(WIDENED):
        layer = layer_pair(kind)[0]
        layer.build(shape)
        layer.set_weights(weights)
        return layer
    inner = type(layer_pair(kind)[0])(dtype="float32")
    inner.build(shape)
    inner.set_weights(weights)
    return Widened(inner)


def traced_with_path(step, path, x, upstream):
    """Call `step` once with `path` forced while it traces; restore the variable.

    A path ending in `FLOAT16_KERNEL`: that path, on a CPU taken to have
    float16 arithmetic while the step traces.
    """
    previous = os.environ.get(_path_choice.PATH_VARIABLE)
    float16_kernel = path.endswith(FLOAT16_KERNEL)
    path = path.removesuffix(FLOAT16_KERNEL).removesuffix(WIDENED)
    os.environ[_path_choice.PATH_VARIABLE] = path
    has_float16_arithmetic = _precision.cpu_has_float16_arithmetic
    if float16_kernel:
        _precision.cpu_has_float16_arithmetic = lambda: True
    try:
        return step(x, upstream)
    finally:
        _precision.cpu_has_float16_arithmetic = has_float16_arithmetic
        if previous is None:
            del os.environ[_path_choice.PATH_VARIABLE]
        else:
            os.environ[_path_choice.PATH_VARIABLE] = previous


def build_steps(kind, shape, policy, step_kind):
    """Return ({name: step}, x, upstream): Keras's, A/A and one per path."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        ours, theirs, again = build_pair(kind, shape, policy)
        dtype = keras.config.dtype_policy().compute_dtype
        forced = {}
        for path in applicable_paths(kind, shape, dtype):
            forced[path] = forced_layer(kind, path, shape, ours.get_weights())
    finally:
        keras.config.set_dtype_policy(previous)
    x, upstream = inputs_for(shape, dtype)
    steps = {
        "keras": make_step(theirs, step_kind, shape, dtype),
        "keras_again": make_step(again, step_kind, shape, dtype),
    }
    reference = steps["keras"](x, upstream)[0]
    steps["keras_again"](x, upstream)
    for path, layer in forced.items():
        steps[path] = make_step(layer, step_kind, shape, dtype)
        outputs = traced_with_path(steps[path], path, x, upstream)[0]
        check_close(outputs, reference, dtype)
    return steps, x, upstream


def time_cell(kind, cell, policy, step_kind, reps, sequence):
    """Return one cell: each path's and the A/A control's ratio to Keras's."""
    shape = fed_shape(kind, cell, sequence)
    steps, x, upstream = build_steps(kind, shape, policy, step_kind)
    medians, reps = time_interleaved(steps, (x, upstream), reps)
    keras_ms = medians.pop("keras")
    ratios = {name: ms / keras_ms for name, ms in medians.items()}
    control = ratios.pop("keras_again")
    return {
        "layer": kind,
        "shape": list(cell),
        "input_shape": list(shape),
        "policy": policy,
        "step": step_kind,
        "keras_ms": keras_ms,
        "ratios": ratios,
        "fastest": min(ratios, key=ratios.get),
        "control_ratio": control,
        "reps": reps,
    }


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 shapes per layer")
    parser.add_argument("--reps", type=int, default=5, help="minimum, default 5")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--steps", nargs="+", default=list(STEPS), choices=STEPS)
    parser.add_argument("--layers", nargs="+", default=["IN"], choices=PATHS)
    parser.add_argument(
        "--sequence", type=int, default=128, help="as in benchmarks/layers.py"
    )
    parser.add_argument(
        "--shapes",
        nargs="+",
        default=None,
        help="only these grid shapes, e.g. 8x64x64x64 (default: the grid)",
    )
    parser.add_argument("--output", type=pathlib.Path, default=None)
    return parser.parse_args()


def chosen_shapes(grid, kind, shapes):
    """Return the grid's shapes of `kind`, only those named in `shapes` if given."""
    if shapes is None:
        return grid[kind]
    named = {tuple(int(n) for n in shape.split("x")) for shape in shapes}
    return [shape for shape in grid[kind] if tuple(shape) in named]


def print_row(row):
    ratios = "  ".join(f"{p} {r:5.2f}" for p, r in row["ratios"].items())
    print(
        f"{row['layer']:<4} {row['shape']!s:<20} {row['policy']:<15} "
        f"{row['step']:<7} {row['keras_ms']:8.2f}  {ratios}  "
        f"A/A {row['control_ratio']:.2f}",
        flush=True,
    )


def main():
    args = parse_args()
    info = print_header("Each normalization path vs Keras's layer, CPU time ratio")
    kind_tag = cpu_kind(info)
    suffix = "_quick" if args.quick else ""
    output = args.output or RESULTS / f"paths_{kind_tag}{suffix}.json"
    grid = QUICK_GRID if args.quick else GRID
    start = time.time()
    print(f"\n{'layer':<4} {'shape':<20} {'policy':<15} {'step':<7} {'keras ms':>8}")
    rows = []
    for kind in args.layers:
        for shape in chosen_shapes(grid, kind, args.shapes):
            for policy in args.policies:
                for step_kind in args.steps:
                    row = time_cell(
                        kind, shape, policy, step_kind, args.reps, args.sequence
                    )
                    rows.append(row)
                    print_row(row)
    print(
        "(ratio = path / Keras's layer CPU time, forward + backward, median;"
        " A/A = a second Keras layer / Keras's, the noise)"
    )
    print(f"wall time {time.time() - start:.0f} s")
    write_results(
        output,
        info,
        {"rows": rows},
        reps=args.reps,
        quick=args.quick,
        sequence=args.sequence,
    )


if __name__ == "__main__":
    main()

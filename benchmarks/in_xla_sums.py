"""Instance norm inside XLA: sums as fused reductions vs batched matrix products.

Inside a step XLA compiles whole, InstanceNormalization channels last takes
its per-sample means as batched matrix products with a ones row
(`_product_means`) and its analytic gradient (`_keras_formula`), where
Keras's `GroupNormalization(groups=-1)` takes reductions, which XLA's CPU
backend fuses with the elementwise ops feeding them into scalar loops. This
script times one forward + backward step (`jit_compile=True`, gradients
w.r.t. the input and both weights) of Keras's program, of the layer's formula
with reductions and autodiff (the layer's program inside XLA before the
products) and of the layer as it runs inside XLA, interleaved in an order
shuffled each round, median process CPU time, at the layer grid's
instance-norm shapes in float32, bfloat16 and float16, and prints each as a
ratio to Keras's program. A fourth form, `half_operands`, is the layer's with
the sums of the input and of the upstream gradient taken from the bfloat16 or
float16 tensors themselves by a product accumulating in float32
(`BatchMatMulV3` with `Tout=float32`; exact, as the ones row is), not from
their float32 copies: whether that saves the widening. (XLA's CPU backend
widens a half-precision dot's operands to float32 itself; the form's
optimized HLO converts them before the dot as the layer's does.)

Usage: python benchmarks/in_xla_sums.py [--quick] [--reps N]
    [--dtypes float32 bfloat16 float16] [--output PATH]
"""

import functools
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf
from layers import GRID, QUICK_GRID
from machine import sweep_options, write_results
from moments_gradient import keras_group_formula, time_cell

from keras_amp_plus.layers import _keras_formula, _product_means, _saved_gradient

DTYPES = ("float32", "bfloat16", "float16")
STAT_AXES = (1, 2)
FORMS = ("reductions", "products", "half_operands")


def reductions(x, gamma, beta, epsilon):
    """The layer's formula with reductions, differentiated by autodiff."""
    outputs, _ = _keras_formula.formula_forward(
        x, gamma, beta, epsilon, STAT_AXES, x.dtype
    )
    return outputs


def products(x, gamma, beta, epsilon):
    """The layer inside XLA: means as batched products, analytic gradient."""
    return _keras_formula.keras_formula_normalize(
        x, gamma, beta, epsilon, STAT_AXES, x.dtype
    )


def _half_operand_mean(t, stat_axes):
    """`_product_means.middle_mean`, from the half tensor `t` was widened from."""
    source = t.op.inputs[0] if t.op.type == "Cast" else t
    if source.dtype not in (tf.bfloat16, tf.float16):
        return _product_means.middle_mean(t, stat_axes)
    dims = tf.shape(source)
    count = tf.reduce_prod(dims[1:-1])
    blocks = tf.reshape(source, tf.stack([dims[0], count, dims[-1]]))
    ones = tf.ones(tf.stack([dims[0], 1, count]), source.dtype)
    sums = tf.raw_ops.BatchMatMulV3(x=ones, y=blocks, Tout=tf.float32)
    kept = tf.concat([dims[:1], tf.ones([len(stat_axes)], tf.int32), dims[-1:]], 0)
    return tf.reshape(sums, kept) / tf.cast(count, tf.float32)


def half_operands(x, gamma, beta, epsilon):
    """`products`, the sums of x and the upstream gradient from half tensors."""
    forward = functools.partial(
        _keras_formula.formula_forward, mean_of=_half_operand_mean
    )
    backward = functools.partial(
        _keras_formula.formula_backward, mean_of=_half_operand_mean
    )
    return _saved_gradient.normalize_with(
        forward, backward, x, gamma, beta, epsilon, STAT_AXES, x.dtype
    )


FORMULAS = {
    "keras": keras_group_formula,
    "reductions": reductions,
    "products": products,
    "half_operands": half_operands,
}


def main():
    args, info, output, reps = sweep_options(
        __doc__,
        "Instance norm inside XLA: reductions vs products",
        "in_xla_sums",
        "2 shapes, 5 reps",
        15,
        DTYPES,
    )
    shapes = (QUICK_GRID if args.quick else GRID)["IN"]
    header = " ".join(f"{name:>10}" for name in FORMS)
    print(f"\n{'shape':<20} {'dtype':<9} {'keras ms':>9} {header}")
    rows = []
    for shape in shapes:
        for dtype in args.dtypes:
            ms = time_cell(shape, dtype, reps, FORMULAS)
            ratios = {name: ms[name] / ms["keras"] for name in FORMS}
            rows.append(
                {"shape": list(shape), "dtype": dtype, "ms": ms, "ratios": ratios}
            )
            cells = " ".join(f"{ratios[name]:10.2f}" for name in FORMS)
            print(f"{shape!s:<20} {dtype:<9} {ms['keras']:9.2f} {cells}", flush=True)
    print("(ratio = that form's time / Keras's program's, median process CPU time)")
    write_results(output, info, {"rows": rows}, reps=reps, quick=args.quick)


if __name__ == "__main__":
    main()

"""Swish inside XLA: Keras's formula vs widened, sigmoid kept or recomputed.

Inside a step XLA compiles whole, the Swish layer is plain ops; what it
chooses there is whether to compute in the input's dtype (Keras's
`Activation("swish")`, `tf.nn.silu`) or widened to float32 and rounded once,
and whether the backward pass keeps the forward's sigmoid (float32: reads it
off the output) or recomputes it (`_swish_activation._recompute_threshold`).
This script times one forward + backward step (`jit_compile=True`, the
input's gradient) of each form, of a float32 multiply (the affine reference
of `benchmarks/layers.py`), of the layer's two forms rounding their
bfloat16 results by XLA's conversion (`tf.cast`) instead of by integer
arithmetic (`_rounding`), and of a form the layer rejects, the sigmoid as
`0.5 + 0.5 * tanh(z / 2)` (XLA's CPU tanh is a rational approximation, no
exponential), whose lower tail the script measures too (relative error
against float64 where the sigmoid is below 1e-4; the exponential's form is
exact to a few ulps there), the layer's recomputing form with an
exponential of plain arithmetic ops (`polynomial_exp`, as accurate as
`tf.exp`) in place of XLA's, and a form keeping the float32 slope
`sigmoid * (1 + x * (1 - sigmoid))` for a backward pass of one multiply
(`slope_kept`), interleaved in an order shuffled each round
(`layers.time_interleaved`: more rounds for cheap cells), median process
CPU time, at Swish shapes of the layer grid and below, per dtype; prints
each form's time as a ratio to Keras's formula and writes JSON named per
CPU kind.

Usage: python benchmarks/swish_xla.py [--quick] [--reps N] [--dtypes ...]
    [--output PATH]
"""

import contextlib
import os
from unittest import mock

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf
from layers import time_interleaved
from machine import sweep_options, write_results

from keras_amp_plus.layers import _rounding, _swish_activation

SHAPES = (
    (256, 256),
    (512, 512),
    (512, 1024),
    (1024, 2048),
    (2048, 2048),
    (4096, 2048),
    (8192, 4096),
)
DTYPES = ("float16", "float32", "bfloat16")
ONE = 1.0


def keras_formula(x):
    """`Activation("swish")`: `tf.nn.silu` in the input's dtype."""
    return tf.nn.silu(x)


def widened_kept(x):
    """float32 arithmetic, rounded once; the backward reads the kept sigmoid.

    A float32 input's is its output (`_swish_activation._sigmoid_from_output`).
    """
    beta = tf.constant(ONE, tf.float32)
    return _swish_activation._swish_choosing_backward_sigmoid(x, beta, False, False)


def widened_recomputed(x):
    """float32 arithmetic, rounded once; the backward recomputes the sigmoid."""
    beta = tf.constant(ONE, tf.float32)
    return _swish_activation._swish_choosing_backward_sigmoid(x, beta, False, True)


def _tanh_sigmoid(z):
    return 0.5 + 0.5 * tf.tanh(0.5 * z)


def tanh_recomputed(x):
    """float32 arithmetic; the sigmoid from tanh, recomputed in the backward."""

    @tf.custom_gradient
    def swish(x):
        def grad(upstream):
            x_wide = tf.cast(x, tf.float32)
            gate = _tanh_sigmoid(x_wide)
            slope = gate * (1.0 + x_wide * (1.0 - gate))
            return tf.cast(tf.cast(upstream, tf.float32) * slope, x.dtype)

        x_wide = tf.cast(x, tf.float32)
        return tf.cast(x_wide * _tanh_sigmoid(x_wide), x.dtype), grad

    return swish(x)


# exp(z) = 2**n * exp(r), n = round(z / ln 2), r = z - n * ln 2 subtracted in
# two parts (Cody and Waite: n * _LN2_HIGH is exact), exp(r) on
# [-ln 2 / 2, ln 2 / 2] a polynomial fitted for least maximal relative error
# (3.8e-9), 2**n built from its bits in two normal factors so that the ends
# of float32's range stay right.
_LOG2_E = 1.4426950408889634
_LN2_HIGH = 0.693145751953125
_LN2_LOW = 1.428606820309417e-06
_EXP_COEFFICIENTS = (
    0.4999999403953552,
    0.1666652113199234,
    0.04166838899254799,
    0.008368710055947304,
    0.001381461275741458,
)


def polynomial_exp(z):
    """`tf.exp` of float32 `z` as arithmetic and bit operations XLA fuses.

    Largest relative error 1.2e-7 over float32's range (`tf.exp`'s too);
    0 for -inf, inf for inf, NaN for NaN.
    """
    clamped = tf.clip_by_value(z, -100.0, 100.0)
    n = tf.round(clamped * _LOG2_E)
    r = clamped - n * _LN2_HIGH - n * _LN2_LOW
    tail = tf.constant(_EXP_COEFFICIENTS[-1])
    for coefficient in reversed(_EXP_COEFFICIENTS[:-1]):
        tail = tail * r + coefficient
    exponent = tf.cast(n, tf.int32)
    half = tf.bitwise.right_shift(exponent, 1)
    return (
        (1.0 + r + r * r * tail) * _power_of_two(half) * _power_of_two(exponent - half)
    )


def _power_of_two(exponent):
    biased = tf.bitwise.left_shift(exponent + 127, 23)
    return tf.bitcast(biased, tf.float32)


def _polynomial_sigmoid(z):
    return 1.0 / (1.0 + polynomial_exp(-z))


def polynomial_exponentials():
    """Return a context in which `tf.exp` and `tf.sigmoid` are `polynomial_exp`'s.

    Entered while a step is traced (its gradient too), it gives the layer's
    forms an exponential XLA fuses as plain arithmetic.
    """
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(tf, "exp", polynomial_exp))
    stack.enter_context(mock.patch.object(tf, "sigmoid", _polynomial_sigmoid))
    return stack


def lower_tail_error(form):
    """Return the largest relative error of `form` in float32 where sigmoid < 1e-4.

    Against float64 `x / (1 + exp(-x))` for x from -80 to -9.3, inside XLA.
    """
    x64 = np.linspace(-80.0, -9.3, 4096)
    outputs = tf.function(form, jit_compile=True)(tf.constant(x64, tf.float32))
    reference = x64 / (1.0 + np.exp(-x64))
    return float(np.max(np.abs(outputs.numpy() - reference) / np.abs(reference)))


def slope_kept(x):
    """float32 arithmetic, rounded once; the forward keeps the float32 slope.

    The backward pass then reads only it and the upstream gradient: one
    multiply, no sigmoid, no x (the same memory as keeping the sigmoid).
    """

    @tf.custom_gradient
    def swish(x):
        x_wide = tf.cast(x, tf.float32)
        gate = tf.sigmoid(x_wide)
        slope = gate * (1.0 + x_wide * (1.0 - gate))

        def grad(upstream):
            return _rounding.rounded_to(tf.cast(upstream, tf.float32) * slope, x.dtype)

        return _rounding.rounded_to(x_wide * gate, x.dtype), grad

    return swish(x)


def affine(x):
    """A float32 multiply: what the input and output cost, no sigmoid."""
    return tf.cast(tf.cast(x, tf.float32) * 2.0, x.dtype)


FORMS = {
    "keras_formula": keras_formula,
    "widened_kept": widened_kept,
    "widened_recomputed": widened_recomputed,
    "tanh_recomputed": tanh_recomputed,
    "slope_kept": slope_kept,
    "affine": affine,
}


# The layer's forms as they were before `_rounding`: their bfloat16 results
# rounded by XLA's conversion (`tf.cast`). The same values; the time differs.
CAST_ROUNDED = {
    "kept_cast_rounding": "widened_kept",
    "recomputed_cast_rounding": "widened_recomputed",
}
# The layer's recomputing form with `polynomial_exp` (traced in
# `polynomial_exponentials`).
POLYNOMIAL = {"recomputed_polynomial_exp": "widened_recomputed"}
STEPS = (*FORMS, *CAST_ROUNDED, *POLYNOMIAL)


def _context_of(name):
    """Return the context the step `name` is traced in."""
    if name in POLYNOMIAL:
        return polynomial_exponentials()
    if name not in CAST_ROUNDED:
        return contextlib.nullcontext()
    return mock.patch.object(_rounding, "rounded_to", _rounded_by_cast)


def _rounded_by_cast(values, dtype):
    return tf.cast(values, dtype)


def xla_step(name):
    """Return a `jit_compile=True` forward + backward step of the form `name`."""
    form = FORMS[{**CAST_ROUNDED, **POLYNOMIAL}.get(name, name)]

    @tf.function(jit_compile=True)
    def step(x, upstream):
        # The whole step: `tape.gradient` traces the custom gradient.
        with _context_of(name), tf.GradientTape() as tape:
            tape.watch(x)
            outputs = form(x)
            gradient = tape.gradient(outputs, x, output_gradients=upstream)
        return outputs, gradient

    return step


def time_cell(shape, dtype, reps):
    """Return the median CPU ms of each form's step at `shape` in `dtype`."""
    x = tf.cast(tf.random.stateless_normal(shape, (1, 2), 0.5), dtype)
    upstream = tf.cast(tf.random.stateless_normal(shape, (3, 4)), dtype)
    steps = {name: xla_step(name) for name in STEPS}
    for step in steps.values():  # compile
        step(x, upstream)
    return time_interleaved(steps, (x, upstream), reps)[0]


def main():
    args, info, output, reps = sweep_options(
        __doc__,
        "Swish inside XLA, forward + backward, ratio to Keras's",
        "swish_xla",
        "3 shapes, 5 reps",
        15,
        DTYPES,
    )
    shapes = SHAPES[1:4] if args.quick else SHAPES
    others = [name for name in STEPS if name != "keras_formula"]
    header = " ".join(f"{name:>18}" for name in others)
    tails = {name: lower_tail_error(FORMS[name]) for name in FORMS if name != "affine"}
    with polynomial_exponentials():
        tails["recomputed_polynomial_exp"] = lower_tail_error(widened_recomputed)
    print("lower tail (sigmoid < 1e-4), largest relative error in float32:")
    for name, error in tails.items():
        print(f"  {name:<20} {error:.2e}")
    print(f"\n{'shape':<14} {'dtype':<9} {'keras ms':>9} {header}")
    rows = []
    for dtype in args.dtypes:
        for shape in shapes:
            ms = time_cell(shape, dtype, reps)
            ratios = {name: ms[name] / ms["keras_formula"] for name in others}
            rows.append(
                {"shape": list(shape), "dtype": dtype, "ms": ms, "ratios": ratios}
            )
            cells = " ".join(f"{ratios[name]:18.2f}" for name in others)
            print(
                f"{shape!s:<14} {dtype:<9} {ms['keras_formula']:9.2f} {cells}",
                flush=True,
            )
    print("(ratio = the form's / Keras's formula's median process CPU time)")
    write_results(
        output,
        info,
        {"rows": rows, "lower_tail_error": tails},
        reps=reps,
        quick=args.quick,
    )


if __name__ == "__main__":
    main()

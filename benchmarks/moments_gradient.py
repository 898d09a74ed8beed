"""Instance norm's formula inside XLA: `tf.nn.moments` vs a variance of its own.

Inside a step XLA compiles whole, normalizations other than instance norm
channels last run Keras's formula and autodiff of it is the layer's gradient.
`tf.nn.moments` (what Keras's layers call) stops the mean's gradient inside
the variance, which breaks the second-order gradient; the layer's formula
(`_keras_formula.formula_forward`) gives the variance its own gradient
instead. This script times one forward +
backward step (`jit_compile=True`, gradients w.r.t. the input and both
weights) of each, interleaved in an order shuffled each round, median process
CPU time, at instance-norm shapes of the layer grid in float32, bfloat16 and
float16, prints a table and writes JSON named per CPU kind.

Usage: python benchmarks/moments_gradient.py [--quick] [--reps N] [--output PATH]
"""

import os
import random
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf
from machine import sweep_options, write_results

from keras_amp_plus.layers import _keras_formula

SHAPES = ((8, 32, 32, 64), (16, 32, 32, 64), (8, 64, 64, 64), (32, 32, 32, 128))
DTYPES = ("float32", "bfloat16", "float16")
STAT_AXES = (1, 2)


def moments_formula(x, gamma, beta, epsilon):
    """Keras's formula with `tf.nn.moments`, as Keras's own layers take it."""
    x_wide = tf.cast(x, gamma.dtype)
    mean, variance = tf.nn.moments(x_wide, list(STAT_AXES), keepdims=True)
    inverse = tf.math.rsqrt(variance + epsilon) * gamma
    return tf.cast(x_wide * inverse + (beta - mean * inverse), x.dtype)


def keras_group_formula(x, gamma, beta, epsilon):
    """`GroupNormalization(groups=-1)`'s program: `(..., channels, 1)` groups."""
    shape = tf.shape(x)
    grouped = tf.cast(tf.reshape(x, tf.concat([shape, [1]], axis=0)), gamma.dtype)
    axes = [*STAT_AXES, x.shape.rank]
    mean, variance = tf.nn.moments(grouped, axes, keepdims=True)
    inverse = tf.math.rsqrt(variance + epsilon) * gamma[..., tf.newaxis]
    shift = -mean * inverse + beta[..., tf.newaxis]
    return tf.reshape(tf.cast(grouped * inverse + shift, x.dtype), shape)


def layer_formula(x, gamma, beta, epsilon):
    """The layer's formula, autodiff of it (its variance differentiable twice)."""
    outputs, _ = _keras_formula.formula_forward(
        x, gamma, beta, epsilon, STAT_AXES, x.dtype
    )
    return outputs


def xla_step(formula, gamma, beta):
    """Return a `jit_compile=True` forward + backward step of `formula`.

    The step returns the outputs with the gradients, as a model's step
    hands them to the next layer: without them XLA would skip writing them
    (and the analytic gradients never read them).
    """

    @tf.function(jit_compile=True)
    def step(x, upstream):
        with tf.GradientTape() as tape:
            tape.watch(x)
            outputs = formula(x, gamma, beta, 1e-3)
        grads = tape.gradient(outputs, [x, gamma, beta], output_gradients=upstream)
        return outputs, grads

    return step


def time_cell(shape, dtype, reps, formulas=None):
    """Return the median CPU ms of each formula's step at `shape`.

    `formulas`: `{name: formula(x, gamma, beta, epsilon)}`, by default
    `tf.nn.moments`' and the layer's.
    """
    channels = (1, 1, 1, shape[-1])
    gamma = tf.Variable(tf.random.stateless_uniform(channels, (1, 2)) + 0.5)
    beta = tf.Variable(tf.random.stateless_normal(channels, (3, 4)))
    x = tf.cast(tf.random.stateless_normal(shape, (5, 6), 5.0, 3.0), dtype)
    upstream = tf.cast(tf.random.stateless_normal(shape, (7, 8)), dtype)
    formulas = formulas or {"tf_nn_moments": moments_formula, "layer": layer_formula}
    steps = {name: xla_step(f, gamma, beta) for name, f in formulas.items()}
    for step in steps.values():  # compile, warm
        step(x, upstream)
        step(x, upstream)
    times = {name: [] for name in steps}
    order, shuffle = list(steps), random.Random(0).shuffle
    for _ in range(reps):
        shuffle(order)
        for name in order:
            start = time.process_time()
            _, grads = steps[name](x, upstream)
            grads[1].numpy()
            times[name].append(time.process_time() - start)
    return {name: 1e3 * statistics.median(values) for name, values in times.items()}


def main():
    args, info, output, reps = sweep_options(
        __doc__,
        "Instance norm's formula inside XLA, forward + backward",
        "moments_gradient",
        "2 shapes, 5 reps",
        30,
    )
    shapes = SHAPES[:2] if args.quick else SHAPES
    header = f"{'tf.nn.moments ms':>17} {'layer ms':>9} {'ratio':>6}"
    print(f"\n{'shape':<20} {'dtype':<9} {header}")
    rows = []
    for shape in shapes:
        for dtype in DTYPES:
            ms = time_cell(shape, dtype, reps)
            ratio = ms["layer"] / ms["tf_nn_moments"]
            rows.append(
                {"shape": list(shape), "dtype": dtype, "ms": ms, "ratio": ratio}
            )
            print(
                f"{shape!s:<20} {dtype:<9} {ms['tf_nn_moments']:17.2f} "
                f"{ms['layer']:9.2f} {ratio:6.3f}",
                flush=True,
            )
    print("(ratio = the layer's formula / tf.nn.moments', median process CPU time)")
    write_results(output, info, {"rows": rows}, reps=reps, quick=args.quick)


if __name__ == "__main__":
    main()

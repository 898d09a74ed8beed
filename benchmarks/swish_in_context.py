"""Swish inside a model XLA compiles whole: its forms after the layer before it.

`benchmarks/swish_xla.py` times Swish's forms alone. Inside a model XLA
compiles whole they fuse with the layer before them, and what wins alone need
not win there. This script times one `jit_compile=True` forward + backward
step (the outputs, and the gradients of the input and of the first layer's
weights) of a
layer followed by Swish in each form: Keras's formula (`tf.nn.silu` in the
compute dtype, `Activation("swish")`), TensorFlow's `silu` widened to float32
and rounded once (`widened_silu`), the layer's own forms keeping the sigmoid
(`kept`: a half-precision input's float32 sigmoid, a float32 input's read off
the output) and recomputing it (`recomputed`; with `swish_xla.py`'s
exponential of plain arithmetic ops, `recomputed_polynomial_exp`), and the
`Swish` layer as it chooses (`layer`). The layers before: none, the package's
InstanceNormalization, a 3x3 Conv2D, Keras's BatchNormalization (batch
statistics), a Dense layer with and without bias (features last); CNN
activation shapes from 1M to 16M
elements; per policy. Interleaved (`layers.time_interleaved`), median process
CPU time; prints each form's time as a ratio to Keras's formula and writes
JSON named per CPU kind.

Usage: python benchmarks/swish_in_context.py [--quick] [--reps N]
    [--dtypes ...] [--output PATH]
"""

import contextlib
import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import tensorflow as tf
from layers import time_interleaved
from machine import sweep_options, write_results
from swish_xla import polynomial_exponentials

from keras_amp_plus import layers
from keras_amp_plus.layers import _swish_activation

SHAPES = ((16, 32, 32, 64), (16, 64, 64, 32), (32, 128, 128, 32))
BEFORE = ("none", "instance_norm", "conv", "batch_norm", "dense", "dense_no_bias")
POLICIES = {
    "bfloat16": "mixed_bfloat16",
    "float16": "mixed_float16",
    "float32": "float32",
}
ONE = tf.constant(1.0, tf.float32)


def keras_formula(x):
    """`Activation("swish")`: `tf.nn.silu` in the input's dtype."""
    return tf.nn.silu(x)


def widened_silu(x):
    """TensorFlow's `silu` in float32, rounded once to the input's dtype."""
    return tf.cast(tf.nn.silu(tf.cast(x, tf.float32)), x.dtype)


def kept(x):
    """The layer's form keeping the sigmoid between the passes."""
    return _swish_activation._swish_choosing_backward_sigmoid(x, ONE, False, False)


def recomputed(x):
    """The layer's form recomputing the sigmoid in the backward pass."""
    return _swish_activation._swish_choosing_backward_sigmoid(x, ONE, False, True)


FORMS = {
    "keras_formula": keras_formula,
    "widened_silu": widened_silu,
    "kept": kept,
    "recomputed": recomputed,
    "recomputed_polynomial_exp": recomputed,  # traced in polynomial_exponentials
    "layer": None,  # a `layers.Swish()` of the step's policy
}


def layer_before(name, policy, channels):
    """Return the layer before Swish (None for none), of `policy`."""
    if name == "instance_norm":
        return layers.InstanceNormalization(dtype=policy)
    if name == "conv":
        return keras.layers.Conv2D(channels, 3, padding="same", dtype=policy)
    if name == "batch_norm":
        return keras.layers.BatchNormalization(dtype=policy)
    if name == "dense":
        return keras.layers.Dense(channels, dtype=policy)
    if name == "dense_no_bias":
        return keras.layers.Dense(channels, use_bias=False, dtype=policy)
    return None


def xla_step(before, name, policy, shape):
    """Return a `jit_compile=True` step: `before`, then form `name`, both passes."""
    first = layer_before(before, policy, shape[-1])
    if first is not None:
        first.build(shape)
    swish = FORMS[name] or layers.Swish(dtype=policy)
    compute = keras.DTypePolicy(policy).compute_dtype
    polynomial = name == "recomputed_polynomial_exp"

    def forward_and_backward(x, upstream):
        with tf.GradientTape() as tape:
            tape.watch(x)
            # Batch statistics, as in training (the other layers ignore it).
            inputs = tf.cast(x, compute) if first is None else first(x, training=True)
            outputs = swish(inputs)
        sources = [x] + ([] if first is None else first.trainable_weights)
        gradients = tape.gradient(
            outputs, sources, output_gradients=tf.cast(upstream, outputs.dtype)
        )
        # The outputs too, as the next layer reads them: unread, XLA would
        # not write them, and the forms that read them back would pay alone.
        return outputs, gradients

    @tf.function(jit_compile=True)
    def step(x, upstream):
        # The gradient is traced in the context too.
        with polynomial_exponentials() if polynomial else contextlib.nullcontext():
            return forward_and_backward(x, upstream)

    return step


def time_cell(before, dtype, shape, reps):
    """Return the median CPU ms of each form's step."""
    policy = POLICIES[dtype]
    x = tf.random.stateless_normal(shape, (1, 2))
    upstream = tf.random.stateless_normal(shape, (3, 4))
    steps = {name: xla_step(before, name, policy, shape) for name in FORMS}
    return time_interleaved(steps, (x, upstream), reps)[0]


def main():
    args, info, output, reps = sweep_options(
        __doc__,
        "Swish after another layer inside XLA, forward + backward, ratio to Keras's",
        "swish_in_context",
        "the two smaller shapes, 5 reps",
        9,
        tuple(POLICIES),
    )
    shapes = SHAPES[:2] if args.quick else SHAPES
    others = [name for name in FORMS if name != "keras_formula"]
    header = " ".join(f"{name:>13}" for name in others)
    print(f"{'before':<14} {'shape':<18} {'dtype':<9} {'keras ms':>9} {header}")
    rows = []
    for dtype in args.dtypes:
        for before in BEFORE:
            for shape in shapes:
                ms = time_cell(before, dtype, shape, reps)
                ratios = {name: ms[name] / ms["keras_formula"] for name in others}
                rows.append(
                    {
                        "before": before,
                        "shape": list(shape),
                        "dtype": dtype,
                        "ms": ms,
                        "ratios": ratios,
                    }
                )
                cells = " ".join(f"{ratios[name]:13.2f}" for name in others)
                print(
                    f"{before:<14} {shape!s:<18} {dtype:<9} "
                    f"{ms['keras_formula']:9.2f} {cells}",
                    flush=True,
                )
    print("(ratio = the form's / Keras's formula's median process CPU time)")
    write_results(output, info, {"rows": rows}, reps=reps, quick=args.quick)


if __name__ == "__main__":
    main()

"""InstanceNormalization inside a model XLA compiles whole: layout and numerics."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import (
    as_float64,
    check_normalization,
    float_inputs,
    hlo_without_names,
    penalty_gradients,
    second_order_reference,
    set_random_weights,
    use_policy,
    xla_step,
)

from keras_amp_plus import layers

SHAPE = (4, 8, 8, 16)


def _optimized_hlo(layer, dtype, any_batch):
    x, upstream, _, _ = float_inputs(SHAPE, 0.0, dtype)
    signature = None
    if any_batch:  # as `fit` traces a `tf.data` pipeline without drop_remainder
        spec = tf.TensorSpec((None, *SHAPE[1:]), dtype)
        signature = [spec, spec]
    step = xla_step(layer, SHAPE, signature)
    return step.experimental_get_compiler_ir(x, upstream)("optimized_hlo")


@pytest.mark.parametrize("any_batch", (False, True))
def test_float16_inside_xla_takes_keras_group_layout(any_batch):
    # The plain layout compiled to a program up to 1.4x slower than Keras's
    # layer in float16; Keras's (..., channels, 1) layout compiles to Keras's
    # program but for the variance's gradient (as fast: 0.997-1.002x it,
    # `benchmarks/moments_gradient.py`). The same sums as Keras's program.
    use_policy("mixed_float16")
    ours = _optimized_hlo(layers.InstanceNormalization(), "float16", any_batch)
    keras_own = _optimized_hlo(
        keras.layers.GroupNormalization(groups=-1), "float16", any_batch
    )
    assert "f32[4,8,8,16,1]" in ours
    assert _reductions(ours) == _reductions(keras_own)


def _reductions(hlo):
    """Return the sorted reduce instructions of `hlo`, names stripped."""
    lines = hlo_without_names(hlo).splitlines()
    reductions = (line.split("=", 1)[1] for line in lines if " reduce(" in line)
    # The reducer's name (`to_apply=`) is numbered per program.
    return sorted(line.split(", to_apply")[0] for line in reductions)


@pytest.mark.parametrize("policy_name", ("mixed_float16", "mixed_bfloat16", "float32"))
def test_inside_xla_differentiates_twice_like_float64(policy_name):
    # A gradient penalty through a model compiled with jit_compile=True:
    # `tf.nn.moments` (Keras's layers) stops the mean's gradient inside the
    # variance and autodiff of the gradient drops a term; every layout the
    # layer takes inside XLA carries the variance's gradient instead.
    compute = use_policy(policy_name).compute_dtype
    layer = layers.InstanceNormalization()
    shape, params = (2, 4, 4, 4), (1, 1, 1, 4)
    layer.build(shape)
    set_random_weights(layer)
    step = tf.function(lambda x: layer(x), jit_compile=True)
    x, upstream, x64, upstream64 = float_inputs(shape, 0.0, compute)
    direction = tf.cast(tf.random.stateless_normal(shape, (1, 2)), compute)
    _, second = penalty_gradients(step, x, upstream, direction)
    gamma = np.reshape(as_float64(layer.gamma), params)
    beta = np.reshape(as_float64(layer.beta), params)
    expected = second_order_reference(
        x64, upstream64, as_float64(direction), gamma, beta, (1, 2)
    )
    # Rounded to the compute dtype a few times on the way: within a few
    # roundings of the largest value (Keras's program is off by up to half).
    tolerance = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 1e-2}[compute]
    atol = tolerance * np.abs(expected).max()
    np.testing.assert_allclose(as_float64(second), expected, rtol=0, atol=atol)


@pytest.mark.parametrize("policy_name", ("float32", "mixed_bfloat16"))
def test_float32_and_bfloat16_inside_xla_keep_the_plain_layout(policy_name):
    # There the plain layout ran as fast (bfloat16) or 10-23% faster (float32).
    compute = use_policy(policy_name).compute_dtype
    hlo = _optimized_hlo(layers.InstanceNormalization(), compute, any_batch=False)
    assert "f32[4,8,8,16]" in hlo
    assert "f32[4,8,8,16,1]" not in hlo


class _InXlaStep:
    """The layer called inside a `jit_compile=True` function, as a model calls it."""

    def __init__(self, layer, any_batch):
        self.inner = layer
        signature = None
        if any_batch:
            signature = [tf.TensorSpec((None, *SHAPE[1:]), layer.compute_dtype)]
        self.call_in_step = tf.function(
            lambda x: layer(x), jit_compile=True, input_signature=signature
        )

    def __getattr__(self, name):  # build, weights, gamma, beta, epsilon
        return getattr(self.inner, name)

    def __call__(self, x):
        return self.call_in_step(x)


@pytest.mark.parametrize("any_batch", (False, True))
@pytest.mark.parametrize("mean", (0.0, 100.0))
def test_float16_inside_xla_matches_float64(mean, any_batch):
    policy = use_policy("mixed_float16")
    layer = _InXlaStep(layers.InstanceNormalization(), any_batch)
    check_normalization(layer, SHAPE, mean, policy, (1, 2), (1, 1, 1, 16))

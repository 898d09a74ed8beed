"""InstanceNormalization inside a model XLA compiles whole: layout and numerics."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import (
    InXlaStep,
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


POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")


@pytest.mark.parametrize("any_batch", (False, True))
@pytest.mark.parametrize("policy_name", POLICIES)
def test_inside_xla_the_sums_are_batched_matrix_products(policy_name, any_batch):
    # XLA's CPU backend runs a reduction fused with the elementwise ops that
    # feed it as a scalar loop; Keras's program sums that way. The layer's
    # four per-sample sums (mean and variance forward, two backward) are one
    # batched dot each, and only the weights' gradients, sums of those
    # (N, C) sums over the batch, are reductions.
    compute = use_policy(policy_name).compute_dtype
    hlo = _optimized_hlo(layers.InstanceNormalization(), compute, any_batch)
    lines = hlo_without_names(hlo).splitlines()
    dots = [line for line in lines if " dot(" in line]
    assert len(dots) == 4
    assert all("f32[4,16]" in line and "lhs_batch_dims={0}" in line for line in dots)
    reductions = [line for line in lines if " reduce(" in line]
    assert len(reductions) == 2
    assert all("dimensions={0}" in line for line in reductions)
    keras_own = _optimized_hlo(
        keras.layers.GroupNormalization(groups=-1), compute, any_batch
    )
    assert " dot(" not in keras_own


@pytest.mark.parametrize("policy_name", POLICIES)
def test_inside_xla_differentiates_twice_like_float64(policy_name):
    # A gradient penalty through a model compiled with jit_compile=True:
    # `tf.nn.moments` (Keras's layers) stops the mean's gradient inside the
    # variance and autodiff of the gradient drops a term. The layer's own
    # gradient is differentiable itself, its variance included.
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


@pytest.mark.parametrize("any_batch", (False, True))
@pytest.mark.parametrize("mean", (0.0, 100.0))
@pytest.mark.parametrize("policy_name", POLICIES)
def test_inside_xla_matches_float64(policy_name, mean, any_batch):
    policy = use_policy(policy_name)
    layer = InXlaStep(layers.InstanceNormalization(), SHAPE, any_batch)
    check_normalization(layer, SHAPE, mean, policy, (1, 2), (1, 1, 1, 16))


@pytest.mark.parametrize(
    "shape, axis, stat_axes, param_shape",
    (
        ((3, 10, 6), -1, (1,), (1, 1, 6)),  # sequences, channels last
        ((2, 4, 5, 3, 6), -1, (1, 2, 3), (1, 1, 1, 1, 6)),  # volumes
        ((2, 6, 5, 4), 1, (2, 3), (1, 6, 1, 1)),  # channels first: autodiff
    ),
    ids=("rank3", "rank5", "channels_first"),
)
def test_other_layouts_inside_xla_match_float64(shape, axis, stat_axes, param_shape):
    policy = use_policy("mixed_bfloat16")
    layer = InXlaStep(layers.InstanceNormalization(axis=axis), shape, True)
    check_normalization(layer, shape, 100.0, policy, stat_axes, param_shape)

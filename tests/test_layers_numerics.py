"""Forward and gradient numerics of the layers against float64 NumPy references."""

import numpy as np
import pytest
import tensorflow as tf
from conftest import (
    POLICIES,
    as_float64,
    assert_close,
    check_normalization,
    check_swish,
    float_inputs,
    normalization_reference,
    run_layer,
    set_random_weights,
    swish_reference,
    use_policy,
)

from keras_amp_plus import layers
from keras_amp_plus.layers import _path_choice

INPUT_MEANS = (0.0, 1000.0)


@pytest.mark.parametrize("mean", INPUT_MEANS)
@pytest.mark.parametrize("policy_name", POLICIES)
def test_layer_normalization_matches_float64(policy_name, mean):
    policy = use_policy(policy_name)
    layer = layers.LayerNormalization()
    check_normalization(layer, (16, 64), mean, policy, (1,), (1, 64))


@pytest.mark.parametrize("policy_name", POLICIES)
def test_layer_normalization_several_axes_matches_float64(policy_name):
    policy = use_policy(policy_name)
    layer = layers.LayerNormalization(axis=[1, 2], epsilon=1e-5)
    check_normalization(layer, (4, 6, 8, 3), 1000.0, policy, (1, 2), (1, 6, 8, 1))


@pytest.mark.parametrize("mean", INPUT_MEANS)
@pytest.mark.parametrize("policy_name", POLICIES)
def test_instance_normalization_matches_float64(policy_name, mean):
    policy = use_policy(policy_name)
    layer = layers.InstanceNormalization()
    check_normalization(layer, (4, 8, 8, 16), mean, policy, (1, 2), (1, 1, 1, 16))


@pytest.mark.parametrize("policy_name", POLICIES)
def test_instance_normalization_channels_first_matches_float64(policy_name):
    policy = use_policy(policy_name)
    layer = layers.InstanceNormalization(axis=1)
    check_normalization(layer, (2, 5, 6, 7), 1000.0, policy, (2, 3), (1, 5, 1, 1))


@pytest.mark.parametrize("trainable_beta", (False, True))
@pytest.mark.parametrize("policy_name", POLICIES)
def test_swish_matches_float64(policy_name, trainable_beta):
    policy = use_policy(policy_name)
    compute = policy.compute_dtype
    layer = layers.Swish(beta=1.5, trainable_beta=trainable_beta)
    x, upstream, _, upstream64 = float_inputs((64, 32), 0.0, compute)
    x = x * 4.0  # cover both tails of the sigmoid
    outputs, grads = run_layer(layer, x, upstream)
    check_swish(outputs, grads, x, upstream64, 1.5, compute, trainable_beta)


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_swish_function_gradient_matches_float64(dtype):
    x, upstream, x64, upstream64 = float_inputs((32, 8), 0.0, dtype)
    beta = tf.Variable(0.7)
    with tf.GradientTape() as tape:
        tape.watch(x)
        outputs = layers.swish(x, beta)
    x_grad, beta_grad = tape.gradient(outputs, [x, beta], output_gradients=upstream)
    outputs64, x_grad64, beta_grad64 = swish_reference(x64, upstream64, 0.7)
    assert_close(outputs, outputs64, dtype, "outputs")
    assert_close(x_grad, x_grad64, dtype, "x gradient")
    assert_close(
        np.array(as_float64(beta_grad)),
        np.array(beta_grad64),
        "float32",
        "beta gradient",
        256,
    )


def test_low_precision_statistics_fail_this_check():
    # Guards the tolerance itself: bfloat16 statistics on N(1000, 1) inputs (what
    # the graph rewrite does to Keras's layer) must not pass `assert_close`.
    x, _, x64, _ = float_inputs((16, 64), 1000.0, "bfloat16")
    mean = tf.reduce_mean(x, axis=-1, keepdims=True)
    variance = tf.reduce_mean(tf.square(x - mean), axis=-1, keepdims=True)
    outputs = (x - mean) * tf.math.rsqrt(variance + 1e-3)
    ones, zeros = np.ones((1, 64)), np.zeros((1, 64))
    ref = normalization_reference(x64, x64, ones, zeros, 1e-3, (1,))
    with pytest.raises(AssertionError, match="outputs"):
        assert_close(outputs, ref[0], "bfloat16", "outputs")


@pytest.mark.parametrize("policy_name", POLICIES)
def test_sums_as_dots_match_float64(policy_name, monkeypatch):
    # The kernels sum as matrix products; the kernels' path forced on small
    # inputs far from zero (shapes used nowhere else, so the kernels are
    # traced afresh): rows (layer norm), middle axes (instance norm) and a
    # middle axis of layer norm.
    monkeypatch.setattr(_path_choice, "DOT_SUM_MIN_ELEMENTS", 0)
    policy = use_policy(policy_name)
    check_normalization(
        layers.LayerNormalization(), (12, 40), 1000.0, policy, (1,), (1, 40)
    )
    check_normalization(
        layers.LayerNormalization(axis=1),
        (12, 40, 3),
        1000.0,
        policy,
        (1,),
        (1, 40, 1),
    )
    check_normalization(
        layers.InstanceNormalization(),
        (3, 5, 7, 6),
        1000.0,
        policy,
        (1, 2),
        (1, 1, 1, 6),
    )


# Rank-3 inputs (batch, 6, 8): statistics axes and weight shapes per layer.
_STAT_AXES = {"LayerNormalization": (2,), "InstanceNormalization": (1,)}
_PARAMS = {"LayerNormalization": (1, 1, 8), "InstanceNormalization": (1, 1, 8)}


@pytest.mark.parametrize("name", ["LayerNormalization", "InstanceNormalization"])
def test_float64_policy_keeps_float64_statistics(name):
    use_policy("float64")
    layer = getattr(layers, name)()
    # N(1000, 1): float32 statistics would be off by ~1e-4 here.
    x, upstream, x64, upstream64 = float_inputs((2, 6, 8), 1000.0, "float64")
    layer.build(x.shape)
    set_random_weights(layer)
    outputs, grads = run_layer(layer, x, upstream)
    assert outputs.dtype == "float64" and grads[0].dtype == "float64"
    ref = normalization_reference(
        x64,
        upstream64,
        np.reshape(as_float64(layer.gamma), _PARAMS[name]),
        np.reshape(as_float64(layer.beta), _PARAMS[name]),
        1e-3,
        _STAT_AXES[name],
    )
    np.testing.assert_allclose(as_float64(outputs), ref[0], atol=1e-9)
    np.testing.assert_allclose(as_float64(grads[0]), ref[1], atol=1e-9)


@pytest.mark.parametrize("name", ["LayerNormalization", "InstanceNormalization"])
@pytest.mark.parametrize(
    "center, scale", [(False, True), (True, False), (False, False)]
)
def test_without_center_or_scale_matches_float64(name, center, scale):
    layer = getattr(layers, name)(center=center, scale=scale)
    x, upstream, x64, upstream64 = float_inputs((3, 5, 8), 10.0, "float32")
    layer.build(x.shape)
    set_random_weights(layer)
    ones = np.ones(_PARAMS[name])
    gamma = np.reshape(as_float64(layer.gamma), _PARAMS[name]) if scale else ones
    beta = np.reshape(as_float64(layer.beta), _PARAMS[name]) if center else 0 * ones
    outputs, grads = run_layer(layer, x, upstream)
    ref = normalization_reference(x64, upstream64, gamma, beta, 1e-3, _STAT_AXES[name])
    assert [w.name for w in layer.trainable_weights] == (
        ["gamma"] * scale + ["beta"] * center
    )
    assert_close(outputs, ref[0], "float32", "outputs", 16)
    assert_close(grads[0], ref[1], "float32", "x gradient", 16)
    expected_weight_grads = [ref[2]] * scale + [ref[3]] * center
    for grad, expected in zip(grads[1:], expected_weight_grads, strict=True):
        assert_close(
            np.reshape(as_float64(grad), _PARAMS[name]),
            expected,
            "float32",
            "weight gradient",
            64,
        )


@pytest.mark.parametrize("name", ["LayerNormalization", "InstanceNormalization"])
def test_eager_calls_on_inputs_far_from_zero_match_float64(name):
    # float32 inputs about 1e5 (ulp 0.008) with a standard deviation of 1:
    # a mean rounded to float32 would shift every output by its rounding.
    rng = np.random.default_rng(0)
    shape, axes = (
        ((4, 6, 64), (-1,))
        if name == "LayerNormalization"
        else (
            (2, 8, 8, 4),
            (1, 2),
        )
    )
    x = (1e5 + rng.normal(size=shape)).astype("float32")
    wide = x.astype("float64")
    mean = wide.mean(axes, keepdims=True)
    expected = (wide - mean) / np.sqrt(wide.var(axes, keepdims=True) + 1e-3)
    layer = getattr(layers, name)(epsilon=1e-3)
    outputs = np.asarray(layer(tf.constant(x)), "float64")
    np.testing.assert_allclose(outputs, expected, atol=1e-4)

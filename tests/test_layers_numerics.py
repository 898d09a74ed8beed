"""Forward and gradient numerics of the layers against float64 NumPy references."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_amp_plus import layers
from keras_amp_plus.layers import _path_choice

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
# One rounding of the output: 2**-8 relative for bfloat16 (8 significant bits),
# 2**-11 for float16, 2**-24 for float32; on top of it the float32 arithmetic
# inside may be off by FLOAT32_SLOP of the tensor's largest value, scaled by how
# far the inputs sit from zero (N(1000, 1) inputs lose ~3 digits to their own
# float32 spacing before any statistics are taken).
ROUNDING = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
FLOAT32_SLOP = 2.0**-20
INPUT_MEANS = (0.0, 1000.0)


def _policy(name):
    keras.config.set_dtype_policy(name)
    return keras.config.dtype_policy()


def _inputs(shape, mean, dtype, seed=0):
    """Random N(mean, 1) inputs already in `dtype`, and their float64 values."""
    rng = np.random.default_rng(seed)
    x = tf.cast(tf.constant(rng.normal(mean, 1.0, shape)), dtype)
    upstream = tf.cast(tf.constant(rng.normal(0.0, 1.0, shape)), dtype)
    return x, upstream, _f64(x), _f64(upstream)


def _f64(tensor):
    return np.asarray(tf.cast(tensor, tf.float64))


def _assert_close(actual, expected, dtype, what, float32_scale=1.0):
    """Within one rounding of `dtype` of each value, plus float32 slop."""
    actual = _f64(actual) if not isinstance(actual, np.ndarray) else actual
    slop = FLOAT32_SLOP * float32_scale * np.abs(expected).max()
    tolerance = ROUNDING[dtype] * np.abs(expected) + slop
    error = np.abs(actual - expected)
    worst = np.unravel_index(np.argmax(error - tolerance), error.shape)
    assert np.all(error <= tolerance), (
        f"{what}: error {error[worst]:.3g} > tolerance {tolerance[worst]:.3g} "
        f"at {worst} (expected {expected[worst]:.6g}, got {actual[worst]:.6g})"
    )


def _normalization_reference(x, upstream, gamma, beta, epsilon, stat_axes):
    """Return output and gradients (x, gamma, beta) of a normalization in float64."""
    mean = x.mean(axis=stat_axes, keepdims=True)
    centered = x - mean
    inverse_stddev = 1.0 / np.sqrt(
        (centered**2).mean(axis=stat_axes, keepdims=True) + epsilon
    )
    normalized = centered * inverse_stddev
    outputs = normalized * gamma + beta
    param_axes = tuple(a for a in range(x.ndim) if gamma.shape[a] == 1)
    gamma_grad = (upstream * normalized).sum(axis=param_axes, keepdims=True)
    beta_grad = upstream.sum(axis=param_axes, keepdims=True)
    scaled = upstream * gamma
    x_grad = inverse_stddev * (
        scaled
        - scaled.mean(axis=stat_axes, keepdims=True)
        - normalized * (scaled * normalized).mean(axis=stat_axes, keepdims=True)
    )
    return outputs, x_grad, gamma_grad, beta_grad


def _run(layer, x, upstream):
    with tf.GradientTape() as tape:
        tape.watch(x)
        outputs = layer(x)
    sources = [x, *layer.trainable_weights]
    grads = tape.gradient(outputs, sources, output_gradients=upstream)
    return outputs, grads


def _set_random_weights(layer, seed=1):
    rng = np.random.default_rng(seed)
    for weight in layer.weights:
        weight.assign(
            rng.normal(1.0 if weight.name == "gamma" else 0.0, 0.3, weight.shape)
        )


def _check_normalization(layer, shape, mean, policy, stat_axes, param_shape):
    compute = policy.compute_dtype
    x, upstream, x64, upstream64 = _inputs(shape, mean, compute)
    layer.build(shape)
    _set_random_weights(layer)
    gamma = np.reshape(_f64(layer.gamma), param_shape)
    beta = np.reshape(_f64(layer.beta), param_shape)
    outputs, (x_grad, gamma_grad, beta_grad) = _run(layer, x, upstream)
    assert outputs.dtype == compute and x_grad.dtype == compute
    assert gamma_grad.dtype == "float32" and beta_grad.dtype == "float32"
    ref = _normalization_reference(
        x64, upstream64, gamma, beta, layer.epsilon, stat_axes
    )
    # float32 inputs near 1000 are spaced 2**-14 = 64 * FLOAT32_SLOP apart.
    far = 1.0 + mean / 8.0
    _assert_close(outputs, ref[0], compute, "outputs", far)
    _assert_close(x_grad, ref[1], compute, "x gradient", far)
    # Weight gradients are float32 sums of products of the compute-dtype tensors.
    _assert_close(
        np.reshape(_f64(gamma_grad), param_shape),
        ref[2],
        "float32",
        "gamma gradient",
        64 * far,
    )
    _assert_close(
        np.reshape(_f64(beta_grad), param_shape), ref[3], "float32", "beta gradient", 64
    )


@pytest.mark.parametrize("mean", INPUT_MEANS)
@pytest.mark.parametrize("policy_name", POLICIES)
def test_layer_normalization_matches_float64(policy_name, mean):
    policy = _policy(policy_name)
    layer = layers.LayerNormalization()
    _check_normalization(layer, (16, 64), mean, policy, (1,), (1, 64))


@pytest.mark.parametrize("policy_name", POLICIES)
def test_layer_normalization_several_axes_matches_float64(policy_name):
    policy = _policy(policy_name)
    layer = layers.LayerNormalization(axis=[1, 2], epsilon=1e-5)
    _check_normalization(layer, (4, 6, 8, 3), 1000.0, policy, (1, 2), (1, 6, 8, 1))


@pytest.mark.parametrize("mean", INPUT_MEANS)
@pytest.mark.parametrize("policy_name", POLICIES)
def test_instance_normalization_matches_float64(policy_name, mean):
    policy = _policy(policy_name)
    layer = layers.InstanceNormalization()
    _check_normalization(layer, (4, 8, 8, 16), mean, policy, (1, 2), (1, 1, 1, 16))


@pytest.mark.parametrize("policy_name", POLICIES)
def test_instance_normalization_channels_first_matches_float64(policy_name):
    policy = _policy(policy_name)
    layer = layers.InstanceNormalization(axis=1)
    _check_normalization(layer, (2, 5, 6, 7), 1000.0, policy, (2, 3), (1, 5, 1, 1))


def _swish_reference(x, upstream, beta):
    sigmoid = 1.0 / (1.0 + np.exp(-beta * x))
    outputs = x * sigmoid
    x_grad = upstream * sigmoid * (1.0 + beta * x * (1.0 - sigmoid))
    beta_grad = (upstream * x**2 * sigmoid * (1.0 - sigmoid)).sum()
    return outputs, x_grad, beta_grad


@pytest.mark.parametrize("trainable_beta", (False, True))
@pytest.mark.parametrize("policy_name", POLICIES)
def test_swish_matches_float64(policy_name, trainable_beta):
    policy = _policy(policy_name)
    compute = policy.compute_dtype
    layer = layers.Swish(beta=1.5, trainable_beta=trainable_beta)
    x, upstream, x64, upstream64 = _inputs((64, 32), 0.0, compute)
    x = x * 4.0  # cover both tails of the sigmoid
    x64 = _f64(x)
    outputs, grads = _run(layer, x, upstream)
    assert outputs.dtype == compute and grads[0].dtype == compute
    outputs64, x_grad64, beta_grad64 = _swish_reference(x64, upstream64, 1.5)
    _assert_close(outputs, outputs64, compute, "outputs")
    _assert_close(grads[0], x_grad64, compute, "x gradient")
    if trainable_beta:
        assert grads[1].dtype == "float32"
        _assert_close(
            np.array(_f64(grads[1])),
            np.array(beta_grad64),
            "float32",
            "beta gradient",
            256,
        )


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
def test_swish_function_gradient_matches_float64(dtype):
    x, upstream, x64, upstream64 = _inputs((32, 8), 0.0, dtype)
    beta = tf.Variable(0.7)
    with tf.GradientTape() as tape:
        tape.watch(x)
        outputs = layers.swish(x, beta)
    x_grad, beta_grad = tape.gradient(outputs, [x, beta], output_gradients=upstream)
    outputs64, x_grad64, beta_grad64 = _swish_reference(x64, upstream64, 0.7)
    _assert_close(outputs, outputs64, dtype, "outputs")
    _assert_close(x_grad, x_grad64, dtype, "x gradient")
    _assert_close(
        np.array(_f64(beta_grad)),
        np.array(beta_grad64),
        "float32",
        "beta gradient",
        256,
    )


def test_low_precision_statistics_fail_this_check():
    # Guards the tolerance itself: bfloat16 statistics on N(1000, 1) inputs (what
    # the graph rewrite does to Keras's layer) must not pass `_assert_close`.
    x, _, x64, _ = _inputs((16, 64), 1000.0, "bfloat16")
    mean = tf.reduce_mean(x, axis=-1, keepdims=True)
    variance = tf.reduce_mean(tf.square(x - mean), axis=-1, keepdims=True)
    outputs = (x - mean) * tf.math.rsqrt(variance + 1e-3)
    ones, zeros = np.ones((1, 64)), np.zeros((1, 64))
    ref = _normalization_reference(x64, x64, ones, zeros, 1e-3, (1,))
    with pytest.raises(AssertionError, match="outputs"):
        _assert_close(outputs, ref[0], "bfloat16", "outputs")


@pytest.mark.parametrize("policy_name", POLICIES)
def test_sums_as_dots_match_float64(policy_name, monkeypatch):
    # Large tensors sum as matrix products; force that path on small ones
    # (shapes used nowhere else, so the kernels are traced afresh).
    monkeypatch.setattr(_path_choice, "DOT_SUM_MIN_ELEMENTS", 0)
    policy = _policy(policy_name)
    _check_normalization(
        layers.LayerNormalization(), (12, 40), 1000.0, policy, (1,), (1, 40)
    )
    _check_normalization(
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
    _policy("float64")
    layer = getattr(layers, name)()
    # N(1000, 1): float32 statistics would be off by ~1e-4 here.
    x, upstream, x64, upstream64 = _inputs((2, 6, 8), 1000.0, "float64")
    layer.build(x.shape)
    _set_random_weights(layer)
    outputs, grads = _run(layer, x, upstream)
    assert outputs.dtype == "float64" and grads[0].dtype == "float64"
    ref = _normalization_reference(
        x64,
        upstream64,
        np.reshape(_f64(layer.gamma), _PARAMS[name]),
        np.reshape(_f64(layer.beta), _PARAMS[name]),
        1e-3,
        _STAT_AXES[name],
    )
    np.testing.assert_allclose(_f64(outputs), ref[0], atol=1e-9)
    np.testing.assert_allclose(_f64(grads[0]), ref[1], atol=1e-9)


@pytest.mark.parametrize("name", ["LayerNormalization", "InstanceNormalization"])
@pytest.mark.parametrize(
    "center, scale", [(False, True), (True, False), (False, False)]
)
def test_without_center_or_scale_matches_float64(name, center, scale):
    layer = getattr(layers, name)(center=center, scale=scale)
    x, upstream, x64, upstream64 = _inputs((3, 5, 8), 10.0, "float32")
    layer.build(x.shape)
    _set_random_weights(layer)
    ones = np.ones(_PARAMS[name])
    gamma = np.reshape(_f64(layer.gamma), _PARAMS[name]) if scale else ones
    beta = np.reshape(_f64(layer.beta), _PARAMS[name]) if center else 0 * ones
    outputs, grads = _run(layer, x, upstream)
    ref = _normalization_reference(x64, upstream64, gamma, beta, 1e-3, _STAT_AXES[name])
    assert [w.name for w in layer.trainable_weights] == (
        ["gamma"] * scale + ["beta"] * center
    )
    _assert_close(outputs, ref[0], "float32", "outputs", 16)
    _assert_close(grads[0], ref[1], "float32", "x gradient", 16)
    expected_weight_grads = [ref[2]] * scale + [ref[3]] * center
    for grad, expected in zip(grads[1:], expected_weight_grads, strict=True):
        _assert_close(
            np.reshape(_f64(grad), _PARAMS[name]),
            expected,
            "float32",
            "weight gradient",
            64,
        )

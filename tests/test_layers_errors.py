"""Bad arguments and inputs raise Keras-style errors naming the received value."""

import numpy as np
import pytest

from keras_amp_plus import layers

NORMALIZATIONS = (layers.LayerNormalization, layers.InstanceNormalization)


@pytest.mark.parametrize("layer", NORMALIZATIONS)
@pytest.mark.parametrize("epsilon", [0.0, -1e-3])
def test_non_positive_epsilon_raises(layer, epsilon):
    with pytest.raises(ValueError, match=f"Received: epsilon={epsilon}"):
        layer(epsilon=epsilon)


@pytest.mark.parametrize("layer", NORMALIZATIONS)
def test_non_numeric_epsilon_raises(layer):
    with pytest.raises(TypeError, match="Received: epsilon='small'"):
        layer(epsilon="small")


@pytest.mark.parametrize("layer", NORMALIZATIONS)
def test_non_integer_axis_raises(layer):
    with pytest.raises(TypeError, match=r"Received: axis=1\.5"):
        layer(axis=1.5)


def test_instance_normalization_axis_list_raises():
    with pytest.raises(TypeError, match=r"Received: axis=\[1, 2\]"):
        layers.InstanceNormalization(axis=[1, 2])


@pytest.mark.parametrize("layer", NORMALIZATIONS)
def test_axis_out_of_bounds_raises_before_weights_exist(layer):
    instance = layer(axis=5)
    with pytest.raises(ValueError, match="Received: axis=5"):
        instance(np.zeros((2, 3, 4, 4), "float32"))
    assert not instance.weights


def test_duplicate_axes_raise():
    with pytest.raises(ValueError, match=r"Received: axis=\[2, -1\]"):
        layers.LayerNormalization(axis=[2, -1])(np.zeros((2, 3, 4), "float32"))


def test_instance_normalization_on_batch_axis_raises():
    with pytest.raises(ValueError, match="Received: axis=0"):
        layers.InstanceNormalization(axis=0)(np.zeros((2, 3, 4), "float32"))


def test_instance_normalization_rank_too_low_raises():
    with pytest.raises(ValueError, match=r"Received: input_shape=\(2, 8\)"):
        layers.InstanceNormalization()(np.zeros((2, 8), "float32"))


def test_layer_normalization_of_a_scalar_raises():
    with pytest.raises(ValueError, match=r"a scalar has none.*input_shape=\(\)"):
        layers.LayerNormalization()(np.float32(1.0))


def test_layer_normalization_rank_too_low_for_axis_raises():
    with pytest.raises(ValueError, match="Received: axis=-2"):
        layers.LayerNormalization(axis=-2)(np.zeros((8,), "float32"))


def test_swish_integer_input_raises():
    # As Keras's swish does: its output would be truncated to integers.
    with pytest.raises(TypeError, match=r"Received: inputs\.dtype=int32"):
        layers.Swish()(np.ones((2, 3, 4), "int32"))


@pytest.mark.parametrize("layer", NORMALIZATIONS)
def test_normalizations_take_integer_inputs_as_keras_does(layer):
    # Keras's LayerNormalization and GroupNormalization cast them to the
    # compute dtype; a model built on `keras.Input(dtype="int32")` works.
    x = np.arange(24, dtype="int32").reshape((2, 3, 4)) % 5
    outputs = np.asarray(layer(epsilon=1e-3)(x))
    x64 = x.astype(np.float64)
    axes = -1 if layer is layers.LayerNormalization else 1
    mean = x64.mean(axes, keepdims=True)
    expected = (x64 - mean) / np.sqrt(x64.var(axes, keepdims=True) + 1e-3)
    assert outputs.dtype == np.float32
    np.testing.assert_allclose(outputs, expected, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match=r"Received: inputs\.dtype=complex64"):
        layer()(np.ones((2, 3, 4), "complex64"))


@pytest.mark.parametrize("layer", NORMALIZATIONS)
@pytest.mark.parametrize("policy", ("mixed_float16", "mixed_bfloat16"))
def test_integer_inputs_keep_their_values_under_mixed_policies(layer, policy):
    # Cast to float16 first, 70000 would be inf; to bfloat16, 1001 rounds.
    x = np.array([[[70000], [70001], [70003]], [[1000], [1001], [1003]]], "int32")
    # Statistics over axis 1: layer norm's axis, instance norm's spatial one.
    axis = {"axis": 1} if layer is layers.LayerNormalization else {}
    normalize = layer(epsilon=1e-3, dtype=policy, **axis)
    outputs = np.asarray(normalize(x)).astype(np.float64)
    x64 = x.astype(np.float64)
    expected = (x64 - x64.mean(1, keepdims=True)) / np.sqrt(
        x64.var(1, keepdims=True) + 1e-3
    )
    np.testing.assert_allclose(outputs, expected, rtol=1e-2, atol=1e-2)


def test_undefined_weight_axis_raises():
    import keras

    with pytest.raises(ValueError, match="undefined"):
        layers.LayerNormalization()(keras.Input((3, None)))


def test_swish_non_numeric_beta_raises():
    with pytest.raises(TypeError, match="Received: beta='one'"):
        layers.Swish(beta="one")


def test_swish_function_integer_input_raises():
    with pytest.raises(TypeError, match=r"Received: x\.dtype=int64"):
        layers.swish(np.array([1, 2, 3]))


# Issue 9: these were accepted (inf epsilon, nan/inf beta) or coerced to True
# (`trainable_beta="no"`), and `swish(x, beta="2")` failed inside TensorFlow.
@pytest.mark.parametrize("layer", NORMALIZATIONS)
@pytest.mark.parametrize("epsilon", [float("inf"), float("nan")])
def test_non_finite_epsilon_raises(layer, epsilon):
    with pytest.raises(ValueError, match=f"Received: epsilon={epsilon}"):
        layer(epsilon=epsilon)


@pytest.mark.parametrize("beta", [float("nan"), float("inf"), -float("inf")])
def test_swish_non_finite_beta_raises(beta):
    with pytest.raises(ValueError, match=f"Received: beta={beta}"):
        layers.Swish(beta=beta)


@pytest.mark.parametrize("trainable_beta", ["no", 1, 0, None, 1.0])
def test_swish_non_bool_trainable_beta_raises(trainable_beta):
    with pytest.raises(TypeError, match="Received: trainable_beta="):
        layers.Swish(trainable_beta=trainable_beta)


@pytest.mark.parametrize("beta", ["2", None, [1.0]])
def test_swish_function_non_numeric_beta_raises(beta):
    with pytest.raises(TypeError, match="Received: beta="):
        layers.swish(np.array([1.0, 2.0], "float32"), beta=beta)


def test_swish_function_refuses_a_beta_per_channel():
    # Its gradient would be summed to one number for every channel.
    import tensorflow as tf

    with pytest.raises(ValueError, match=r"Received: beta\.shape=\(3,\)"):
        layers.swish(np.ones((2, 3), "float32"), beta=tf.Variable([0.5, 1.0, 2.0]))


def test_swish_function_refuses_a_numpy_beta_per_channel():
    with pytest.raises(ValueError, match=r"Received: beta\.shape=\(3,\)"):
        layers.swish(np.ones((2, 3), "float32"), beta=np.array([0.5, 1.0, 2.0]))


def test_swish_function_takes_a_zero_dimensional_numpy_beta():
    x = np.array([-1.0, 0.0, 2.0])
    outputs = layers.swish(x.astype("float32"), beta=np.array(2.0))
    expected = x / (1.0 + np.exp(-2.0 * x))  # float64 reference
    np.testing.assert_allclose(np.asarray(outputs), expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("beta", [float("nan"), float("inf")])
def test_swish_function_refuses_a_non_finite_numpy_beta(beta):
    with pytest.raises(ValueError, match="`beta` must be finite"):
        layers.swish(np.ones((2, 3), "float32"), beta=np.array(beta))

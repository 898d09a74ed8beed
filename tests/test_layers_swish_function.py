"""`keras_amp_plus.layers.swish` works wherever `keras.activations.swish` does."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_amp_plus import layers


def _reference(x, beta=1.0):
    x = np.asarray(x, np.float64)
    return x / (1.0 + np.exp(-beta * x))


def test_swish_on_a_keras_tensor_builds_a_functional_model():
    # Issue 9: raised "A KerasTensor cannot be used as input to a TensorFlow
    # function" where keras.activations.swish works.
    inputs = keras.Input((5,))
    outputs = layers.swish(inputs, beta=1.5)
    assert tuple(outputs.shape) == (None, 5)
    model = keras.Model(inputs, outputs)
    x = np.linspace(-4.0, 4.0, 10, dtype="float32").reshape(2, 5)
    np.testing.assert_allclose(
        model.predict(x, verbose=0), _reference(x, 1.5), rtol=1e-6, atol=1e-7
    )


def test_a_functional_model_calling_swish_reloads_from_its_keras_file(tmp_path):
    inputs = keras.Input((5,))
    hidden = layers.swish(keras.layers.Dense(5, name="dense")(inputs), beta=1.5)
    model = keras.Model(inputs, layers.swish(hidden))
    x = np.linspace(-4.0, 4.0, 10, dtype="float32").reshape(2, 5)
    path = str(tmp_path / "model.keras")
    model.save(path)
    reloaded = keras.saving.load_model(path)
    np.testing.assert_array_equal(
        reloaded.predict(x, verbose=0), model.predict(x, verbose=0)
    )
    kernel, bias = (
        w.numpy().astype(np.float64) for w in model.get_layer("dense").weights
    )
    expected = _reference(_reference(x @ kernel + bias, 1.5))
    np.testing.assert_allclose(reloaded.predict(x, verbose=0), expected, rtol=1e-5)


def test_a_model_calling_swish_with_a_tensor_beta_says_why_it_cannot_be_saved(
    tmp_path,
):
    inputs = keras.Input((5,))
    model = keras.Model(inputs, layers.swish(inputs, beta=tf.constant(1.5)))
    with pytest.raises(ValueError, match="with a tensor `beta` cannot be saved"):
        model.save(str(tmp_path / "model.keras"))


def test_swish_on_a_keras_tensor_keeps_its_dtype():
    inputs = keras.Input((3,), dtype="bfloat16")
    assert layers.swish(inputs).dtype == "bfloat16"


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_swish_works_on_every_float_dtype(dtype):
    x = tf.cast(tf.linspace(-6.0, 6.0, 25), dtype)
    with tf.GradientTape() as tape:
        tape.watch(x)
        outputs = layers.swish(x)
    grad = tape.gradient(outputs, x)
    assert outputs.dtype == dtype and grad.dtype == dtype
    tolerance = {"float16": 2e-3, "bfloat16": 1e-2, "float32": 1e-6}
    np.testing.assert_allclose(
        np.asarray(tf.cast(outputs, tf.float64)),
        _reference(tf.cast(x, tf.float64)),
        rtol=tolerance.get(dtype, 1e-12),
        atol=tolerance.get(dtype, 1e-12),
    )


def test_instance_normalization_groups_property():
    # Issue 9: TF Addons' InstanceNormalization and Keras's GroupNormalization
    # have `groups`; one group per channel (-1 until the channels are known).
    layer = layers.InstanceNormalization()
    assert layer.groups == -1
    layer.build((2, 4, 4, 6))
    assert layer.groups == 6
    assert "groups" not in layer.get_config()
    assert layers.InstanceNormalization(axis=1, groups=3).groups == 3

"""Drop-in compatibility with Keras's layers, TF Addons configs and activations."""

import json

import keras
import numpy as np
import pytest

from keras_amp_plus import layers

FEATURES = 8


def _sample(shape=(3, 5, FEATURES), seed=0):
    return np.random.default_rng(seed).normal(2.0, 3.0, shape).astype("float32")


def _randomize(layer, seed=1):
    rng = np.random.default_rng(seed)
    for weight in layer.weights:
        weight.assign(rng.normal(0.5, 0.5, weight.shape))


def _model(norm_layer):
    inputs = keras.Input((5, FEATURES))
    hidden = keras.layers.Dense(FEATURES, name="dense")(inputs)
    outputs = norm_layer(hidden)
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(outputs))


@pytest.mark.parametrize(
    "arguments",
    [{}, {"axis": [1, 2], "epsilon": 1e-5, "center": False}, {"scale": False}],
)
def test_keras_layer_normalization_config_loads_into_ours_and_back(arguments):
    keras_layer = keras.layers.LayerNormalization(**arguments)
    keras_layer.build((None, 5, FEATURES))
    config = json.loads(json.dumps(keras_layer.get_config()))
    ours = layers.LayerNormalization.from_config(config)
    assert ours.get_config() == config
    back = keras.layers.LayerNormalization.from_config(ours.get_config())
    assert back.get_config() == config
    ours.build((None, 5, FEATURES))
    assert [(w.name, w.shape) for w in ours.weights] == [
        (w.name, w.shape) for w in keras_layer.weights
    ]


def test_same_config_keys_as_keras_layer_normalization():
    assert set(layers.LayerNormalization().get_config()) == set(
        keras.layers.LayerNormalization().get_config()
    )


def test_deprecated_rms_scaling_is_accepted_like_keras():
    with pytest.warns(UserWarning, match="rms_scaling"):
        keras_layer = keras.layers.LayerNormalization(rms_scaling=True)
    with pytest.warns(UserWarning, match="rms_scaling"):
        ours = layers.LayerNormalization(rms_scaling=True)
    assert ours.get_config()["rms_scaling"] is True
    x = _sample()
    keras_layer.build(x.shape)
    ours.build(x.shape)
    _randomize(keras_layer)
    ours.set_weights(keras_layer.get_weights())
    with pytest.warns(UserWarning, match="rms_scaling"):
        expected = np.asarray(keras_layer(x))
    np.testing.assert_allclose(np.asarray(ours(x)), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("axis", [-1, [1, 2]])
def test_weights_copied_from_keras_give_same_float32_outputs(axis):
    x = _sample()
    keras_layer = keras.layers.LayerNormalization(axis=axis)
    ours = layers.LayerNormalization(axis=axis)
    keras_layer.build(x.shape)
    ours.build(x.shape)
    _randomize(keras_layer)
    ours.set_weights(keras_layer.get_weights())
    np.testing.assert_allclose(
        np.asarray(ours(x)), np.asarray(keras_layer(x)), rtol=1e-6, atol=1e-6
    )


def test_weights_file_of_keras_layer_loads_into_ours(tmp_path):
    keras_model = _model(keras.layers.LayerNormalization(name="norm"))
    _randomize(keras_model.get_layer("norm"))
    path = tmp_path / "keras_norm.weights.h5"
    keras_model.save_weights(path)
    ours_model = _model(layers.LayerNormalization(name="norm"))
    ours_model.load_weights(path)
    for ours_weight, keras_weight in zip(
        ours_model.weights, keras_model.weights, strict=True
    ):
        np.testing.assert_array_equal(np.asarray(ours_weight), np.asarray(keras_weight))
    x = _sample()
    np.testing.assert_allclose(
        np.asarray(ours_model(x)), np.asarray(keras_model(x)), rtol=1e-5, atol=1e-5
    )
    # And the other way round.
    path_back = tmp_path / "ours_norm.weights.h5"
    ours_model.save_weights(path_back)
    keras_model.load_weights(path_back)
    np.testing.assert_allclose(
        np.asarray(ours_model(x)), np.asarray(keras_model(x)), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    "layer",
    [layers.LayerNormalization, layers.InstanceNormalization, layers.Swish],
)
def test_mask_passes_through(layer):
    inputs = keras.Input((5, FEATURES))
    masked = keras.layers.Masking(mask_value=0.0)(inputs)
    outputs = layer()(masked)
    assert outputs._keras_mask is not None  # the mask reached the output
    instance = layer()
    mask = np.array([[True, False, True, True, False]])
    np.testing.assert_array_equal(
        np.asarray(instance.compute_mask(_sample((1, 5, FEATURES)), mask)), mask
    )


def test_instance_normalization_equals_group_normalization_in_float32():
    x = _sample((2, 6, 7, FEATURES))
    group_norm = keras.layers.GroupNormalization(groups=-1, epsilon=1e-3)
    ours = layers.InstanceNormalization(epsilon=1e-3)
    group_norm.build(x.shape)
    ours.build(x.shape)
    _randomize(group_norm)
    ours.set_weights(group_norm.get_weights())
    np.testing.assert_allclose(
        np.asarray(ours(x)), np.asarray(group_norm(x)), rtol=1e-5, atol=1e-5
    )


def _addons_config(groups):
    # Written the way TF Addons 0.23 (Keras 2) serialized the layer.
    return {
        "class_name": "Addons>InstanceNormalization",
        "config": {
            "name": "instance_norm",
            "trainable": True,
            "dtype": "float32",
            "groups": groups,
            "axis": -1,
            "epsilon": 1e-5,
            "center": True,
            "scale": True,
            "beta_initializer": {"class_name": "Zeros", "config": {}},
            "gamma_initializer": {"class_name": "Ones", "config": {}},
            "beta_regularizer": None,
            "gamma_regularizer": None,
            "beta_constraint": None,
            "gamma_constraint": None,
        },
    }


@pytest.mark.parametrize("groups", [-1, FEATURES])
def test_addons_instance_normalization_config_deserializes_into_ours(groups):
    layer = keras.saving.deserialize_keras_object(_addons_config(groups))
    assert type(layer) is layers.InstanceNormalization
    assert layer.epsilon == 1e-5
    outputs = layer(_sample((2, 4, 4, FEATURES)))
    assert outputs.shape == (2, 4, 4, FEATURES)
    # Re-saved, it is ours, not TF Addons'.
    serialized = keras.saving.serialize_keras_object(layer)
    assert serialized["registered_name"] == "keras_amp_plus>InstanceNormalization"


def test_addons_config_with_other_groups_raises():
    layer = keras.saving.deserialize_keras_object(_addons_config(2))
    with pytest.raises(ValueError, match="groups=2"):
        layer(_sample((2, 4, 4, FEATURES)))
    with pytest.raises(ValueError, match="groups=0"):
        layers.InstanceNormalization(groups=0)


def test_swish_function_as_keras_activation():
    by_object = keras.layers.Dense(4, activation=layers.swish)
    config = json.loads(json.dumps(by_object.get_config()))
    restored = keras.layers.Dense.from_config(config)
    assert restored.activation is layers.swish
    assert keras.activations.get(keras.activations.serialize(layers.swish)) is (
        layers.swish
    )
    # The built-in name still means Keras's own silu.
    assert keras.activations.get("swish") is keras.activations.swish


def test_swish_layer_matches_keras_activation_in_float32():
    x = _sample()
    np.testing.assert_allclose(
        np.asarray(layers.Swish()(x)),
        np.asarray(keras.layers.Activation("swish")(x)),
        rtol=1e-6,
        atol=1e-6,
    )

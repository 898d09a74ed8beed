"""Every exported layer: serialization, saving, weight and output dtypes."""

import json

import keras
import numpy as np
import pytest

import keras_amp_plus.layers

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
INPUT_SHAPE = (6, 5, 4)  # per sample: fits LN, IN (channels last) and Swish
# Non-default arguments, so a round trip that drops one is caught.
ARGUMENTS = {
    "LayerNormalization": {"axis": [-2, -1], "epsilon": 1e-4, "center": False},
    "InstanceNormalization": {"epsilon": 1e-5, "center": False},
    "Swish": {"beta": 1.25, "trainable_beta": True},
}
EXPORTED_LAYERS = [
    name
    for name in keras_amp_plus.layers.__all__
    if isinstance(getattr(keras_amp_plus.layers, name), type)
]


def test_every_exported_layer_is_covered():
    assert sorted(EXPORTED_LAYERS) == sorted(ARGUMENTS)


def _make(name, **overrides):
    return getattr(keras_amp_plus.layers, name)(**{**ARGUMENTS[name], **overrides})


def _model(layer):
    inputs = keras.Input(INPUT_SHAPE)
    hidden = keras.layers.Dense(INPUT_SHAPE[-1])(inputs)
    return keras.Model(inputs, layer(hidden))


def _sample(seed=0):
    return np.random.default_rng(seed).normal(3.0, 2.0, (2, *INPUT_SHAPE))


@pytest.mark.parametrize("name", EXPORTED_LAYERS)
def test_config_json_round_trip(name):
    layer = _make(name)
    config = layer.get_config()
    restored = type(layer).from_config(json.loads(json.dumps(config)))
    assert restored.get_config() == config
    for key, value in ARGUMENTS[name].items():
        assert config[key] == value


@pytest.mark.parametrize("name", EXPORTED_LAYERS)
def test_config_unchanged_by_build(name):
    layer = _make(name)
    before = layer.get_config()
    layer.build((None, *INPUT_SHAPE))
    after = layer.get_config()
    if name == "LayerNormalization":
        # Keras's own LayerNormalization stores its sorted axis list at build;
        # ours matches it exactly (drop-in), which only reorders this list.
        before["axis"] = sorted(before["axis"])
    assert after == before


@pytest.mark.parametrize("name", EXPORTED_LAYERS)
def test_serialize_deserialize_keras_object(name):
    layer = _make(name)
    serialized = keras.saving.serialize_keras_object(layer)
    assert serialized["registered_name"] == f"keras_amp_plus>{name}"
    restored = keras.saving.deserialize_keras_object(json.loads(json.dumps(serialized)))
    assert type(restored) is type(layer)
    assert restored.get_config() == layer.get_config()


@pytest.mark.parametrize("name", EXPORTED_LAYERS)
def test_keras_file_round_trip_gives_equal_outputs(name, tmp_path):
    model = _model(_make(name))
    # Non-trivial weights, so loading the wrong ones shows.
    rng = np.random.default_rng(1)
    for weight in model.weights:
        weight.assign(rng.normal(1.0, 0.2, weight.shape))
    path = tmp_path / "model.keras"
    model.save(path)
    loaded = keras.saving.load_model(path)
    assert type(loaded.layers[-1]) is type(model.layers[-1])
    np.testing.assert_array_equal(
        loaded.predict(_sample(), verbose=0), model.predict(_sample(), verbose=0)
    )


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", EXPORTED_LAYERS)
def test_weight_and_output_dtypes(name, policy):
    keras.config.set_dtype_policy(policy)
    layer = _make(name)
    model = _model(layer)
    outputs = model(_sample())
    compute = keras.config.dtype_policy().compute_dtype
    assert keras.backend.standardize_dtype(outputs.dtype) == compute
    assert layer.weights, "every exported layer has at least one weight here"
    assert all(weight.dtype == "float32" for weight in layer.weights)
    # One training step: gradients reach the float32 weights, which change.
    optimizer = keras.optimizers.SGD(0.1)
    if policy == "mixed_float16":
        # At Keras's default loss scale (2**15) the Dense layer's float16
        # gradients overflowed on about half the random initializations, the
        # step was skipped and no weight changed.
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer, initial_scale=1.0)
    model.compile(optimizer=optimizer, loss="mse")
    before = [np.array(w) for w in layer.weights]
    model.fit(_sample(), _sample(1), epochs=1, verbose=0)
    assert all(w.dtype == "float32" for w in layer.weights)
    assert any(
        not np.array_equal(b, np.array(w))
        for b, w in zip(before, layer.weights, strict=True)
    )


@pytest.mark.parametrize("jit_compile", (False, True))
def test_trains_in_a_model_with_partial_batches(jit_compile):
    # Regression: shapes built with a scatter could not be evaluated at compile
    # time once the layers' XLA kernels were inlined into a jit-compiled model.
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = keras.Sequential(
        [
            keras.Input(INPUT_SHAPE),
            keras.layers.Dense(INPUT_SHAPE[-1]),
            *[_make(name) for name in EXPORTED_LAYERS],
        ]
    )
    model.compile(optimizer="adam", loss="mse", jit_compile=jit_compile)
    x = np.concatenate([_sample(0), _sample(1), _sample(2)])  # 6 samples
    history = model.fit(x, x * 0.1, batch_size=4, epochs=2, verbose=0)
    assert np.all(np.isfinite(history.history["loss"]))
    assert history.history["loss"][1] < history.history["loss"][0]

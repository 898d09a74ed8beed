"""Models with our layers exported for serving (`model.export`) and loaded back.

A SavedModel keeps the traced graph, not the Python layers: the loaded
`serve` endpoint must give the in-memory model's outputs at any batch size
(the layers pick their path from the size at run time), and gradients taken
through it (fine-tuning a loaded model) must be the in-memory model's.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_amp_plus import layers

POLICIES = ("float32", "mixed_bfloat16", "mixed_float16")
# The served graph is optimized as a graph (grappler's fusions, the layers'
# graph paths), the model runs eagerly: sums in another order. Through five
# layers float32 results then differ by a few units in the sixth digit, 16-bit
# ones by a rounding.
LAST_PLACE = {"float32": 2.0**-16, "bfloat16": 2.0**-7, "float16": 2.0**-10}
SEQUENCE, FEATURES = 6, 16


def _model():
    inputs = keras.Input((SEQUENCE, FEATURES))
    hidden = keras.layers.Dense(FEATURES, name="proj")(inputs)
    hidden = layers.LayerNormalization(name="ln")(hidden)
    hidden = layers.Swish(name="swish")(hidden)
    hidden = keras.layers.Reshape((SEQUENCE, FEATURES, 1))(hidden)
    # No bias: the instance norm takes it out (its gradient is rounding noise).
    conv = keras.layers.Conv2D(4, 3, padding="same", use_bias=False, name="conv")
    hidden = conv(hidden)
    hidden = layers.InstanceNormalization(name="inorm")(hidden)
    outputs = keras.layers.Dense(3, name="head")(keras.layers.Flatten()(hidden))
    model = keras.Model(inputs, outputs)
    rng = np.random.default_rng(0)
    for weight in model.weights:
        weight.assign(rng.normal(0.5, 0.5, weight.shape))
    return model


def _inputs(batch, seed):
    rng = np.random.default_rng(seed)
    return tf.constant(rng.normal(1.0, 2.0, (batch, SEQUENCE, FEATURES)), "float32")


def _as_float64(tensor):
    return np.asarray(tf.cast(tensor, tf.float64))


@pytest.fixture(params=POLICIES)
def exported(request, tmp_path):
    """Return (in-memory model, loaded SavedModel), built in the policy."""
    keras.config.set_dtype_policy(request.param)
    model = _model()
    path = str(tmp_path / "served")
    model.export(path, verbose=False)
    return model, tf.saved_model.load(path)


@pytest.mark.parametrize("batch", [1, 5, 512])
def test_served_outputs_are_the_models_at_any_batch_size(exported, batch):
    model, loaded = exported
    x = _inputs(batch, seed=batch)
    served = loaded.serve(x)
    assert served.dtype == model.compute_dtype
    expected = _as_float64(model(x))
    tolerance = LAST_PLACE[model.compute_dtype] * np.abs(expected).max()
    np.testing.assert_allclose(_as_float64(served), expected, rtol=0, atol=tolerance)


def test_gradients_through_the_loaded_model_are_the_models(exported):
    model, loaded = exported
    x = _inputs(4, seed=7)
    weights = np.random.default_rng(1).normal(0.0, 1.0, (4, 3))

    def gradients(call, variables):
        with tf.GradientTape() as tape:
            tape.watch(x)
            loss = tf.reduce_sum(tf.cast(call(x), tf.float32) * weights)
        return tape.gradient(loss, [x, *variables])

    ours = gradients(loaded.serve, loaded.variables)
    # A loaded variable's name is the saved one's path, with ":0".
    paths = (v.name.removesuffix(":0") for v in loaded.variables)
    by_path = dict(zip(paths, ours[1:], strict=True))
    theirs = gradients(model, model.trainable_variables)
    assert all(gradient is not None for gradient in ours)
    pairs = [(ours[0], theirs[0])] + [
        (by_path[v.path], g)
        for v, g in zip(model.trainable_variables, theirs[1:], strict=True)
    ]
    for loaded_gradient, model_gradient in pairs:
        expected = _as_float64(model_gradient)
        tolerance = LAST_PLACE[model.compute_dtype] * np.abs(expected).max()
        np.testing.assert_allclose(
            _as_float64(loaded_gradient), expected, rtol=0, atol=4 * tolerance
        )

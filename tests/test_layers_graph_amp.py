"""Statistics stay float32 under TensorFlow's graph-level bfloat16 rewrite.

`auto_mixed_precision_onednn_bfloat16` paints Keras's LayerNormalization
statistics ops bfloat16 (see the notes in graph-amp-and-itex.md); ours run in
an XLA-compiled function, which the rewrite leaves alone.
"""

import contextlib

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_amp_plus import _compat, layers

REWRITE = "auto_mixed_precision_onednn_bfloat16"
FEATURES = 64


@contextlib.contextmanager
def bf16_graph_rewrite():
    if _compat.onednn_enabled() is False:
        # Without oneDNN (TF_ENABLE_ONEDNN_OPTS=0, or CPUs where TensorFlow
        # leaves it off) grappler's onednn bfloat16 rewrite changes nothing, so
        # there is no painted statistic to guard against.
        pytest.skip("the oneDNN bfloat16 graph rewrite is a no-op with oneDNN off")
    previous = tf.config.optimizer.get_experimental_options().get(REWRITE)
    tf.config.optimizer.set_experimental_options({REWRITE: True})
    try:
        yield
    finally:
        if previous is None:
            _compat.reset_grappler_option(REWRITE)
        else:
            tf.config.optimizer.set_experimental_options({REWRITE: previous})


def _far_inputs():
    # N(1000, ~8) rounded to values bfloat16 holds exactly (spacing 4 near
    # 1000), so the bfloat16 MatMul in front of the layer passes them unchanged
    # and any error comes from the layer's statistics.
    rng = np.random.default_rng(0)
    return (1000 + 4 * rng.integers(-3, 4, (32, FEATURES))).astype("float32")


def _reference(x, epsilon=1e-3):
    x = x.astype(np.float64)
    mean = x.mean(-1, keepdims=True)
    return (x - mean) / np.sqrt(x.var(-1, keepdims=True) + epsilon)


def _max_error_under_rewrite(norm_layer, x):
    inputs = keras.Input((FEATURES,))
    # An ALLOW-list op (MatMul) in front, so the rewrite paints what follows.
    hidden = keras.layers.Dense(
        FEATURES, use_bias=False, kernel_initializer="identity"
    )(inputs)
    model = keras.Model(inputs, norm_layer(hidden))
    outputs = tf.function(model)(tf.constant(x))
    return np.abs(np.asarray(outputs, np.float64) - _reference(x)).max()


def test_statistics_stay_float32_under_bf16_graph_rewrite():
    options_before = tf.config.optimizer.get_experimental_options()
    x = _far_inputs()
    with bf16_graph_rewrite():
        ours = _max_error_under_rewrite(layers.LayerNormalization(), x)
        keras_error = _max_error_under_rewrite(keras.layers.LayerNormalization(), x)
    assert tf.config.optimizer.get_experimental_options() == options_before
    assert ours < 1e-5  # float32 statistics
    # The rewrite really was on: Keras's own layer lost its float32 statistics.
    assert keras_error > 0.05


def _max_error_on_sequences(norm_layer, length):
    """Like `_max_error_under_rewrite`, on one (32, FEATURES) sequence.

    An Einsum (ALLOW list) in front: with a rank-3 input, Dense's MatMul sits
    behind reshapes and the rewrite left Keras's own layer float32.
    """
    x = _far_inputs()
    inputs = keras.Input((length, FEATURES))
    hidden = keras.layers.EinsumDense(
        "abc,cd->abd", (length, FEATURES), kernel_initializer="identity"
    )(inputs)
    model = keras.Model(inputs, norm_layer(hidden))
    outputs = np.asarray(tf.function(model)(tf.constant(x[None])), np.float64)
    return np.abs(outputs[0] - _reference(x)).max()


def test_instance_and_variable_length_statistics_stay_float32_under_rewrite():
    with bf16_graph_rewrite():
        # Unknown length: the padded-rows path of LayerNormalization.
        variable = _max_error_on_sequences(layers.LayerNormalization(), None)
        keras_variable = _max_error_on_sequences(
            keras.layers.LayerNormalization(), None
        )
        # Channels on axis 1: each of the 32 rows is one channel.
        instance = _max_error_on_sequences(layers.InstanceNormalization(axis=1), 32)
        # (Keras's GroupNormalization kept float32 here; its LayerNormalization,
        # the same statistics on this input, did not.)
        keras_instance = _max_error_on_sequences(keras.layers.LayerNormalization(), 32)
    assert variable < 1e-5 and instance < 1e-5  # float32 statistics
    # The rewrite really was on: Keras's layers lost their float32 statistics.
    assert keras_variable > 0.05 and keras_instance > 0.05

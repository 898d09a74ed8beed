"""Inputs whose shape changes between steps: numerics and bounded recompilation."""

import json
import os
import subprocess
import sys
import textwrap

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import (
    as_float64,
    float_inputs,
    normalization_reference,
    second_order_reference,
    set_random_weights,
)

from keras_amp_plus import layers
from keras_amp_plus.layers import _row_buckets

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
FEATURES = 16
# Relative to the largest value; float32 loses ~2**-14 to N(1000, 1) inputs.
TOLERANCE = {"float32": 1e-4, "float16": 4e-3, "bfloat16": 3e-2}


def test_row_buckets_bound_padding_and_count():
    rows = np.arange(1, 5001)
    buckets = np.asarray(_row_buckets.bucket_rows(rows))
    assert np.all(buckets >= rows)
    assert np.all(buckets <= np.maximum(1.5 * rows, rows + 1))
    # Two sizes per power of two (at most three per octave with its ends).
    assert len(set(buckets.tolist())) <= 2 * int(np.ceil(np.log2(5000))) + 1
    assert int(_row_buckets.bucket_rows(0)) == 1


def _reference(x, upstream, gamma, beta, epsilon=1e-3):
    """Float64 layer norm over the last axis: output, x and weight gradients."""
    mean = x.mean(-1, keepdims=True)
    inverse_stddev = 1 / np.sqrt(((x - mean) ** 2).mean(-1, keepdims=True) + epsilon)
    normalized = (x - mean) * inverse_stddev
    scaled = upstream * gamma
    x_grad = inverse_stddev * (
        scaled
        - scaled.mean(-1, keepdims=True)
        - normalized * (scaled * normalized).mean(-1, keepdims=True)
    )
    leading = tuple(range(x.ndim - 1))
    return (
        normalized * gamma + beta,
        x_grad,
        (upstream * normalized).sum(leading),
        upstream.sum(leading),
    )


def _graph_step(layer, dtype, weights=(), with_gradients=True):
    """A graph step for any batch and length: outputs, gradients of x, weights."""
    spec = tf.TensorSpec((None, None, FEATURES), dtype)

    @tf.function(input_signature=[spec, spec])
    def step(x, upstream):
        with tf.GradientTape() as tape:
            tape.watch(x)
            outputs = layer(x)
        if not with_gradients:
            return outputs
        sources = [x, *weights]
        return outputs, tape.gradient(outputs, sources, output_gradients=upstream)

    return step


@pytest.mark.parametrize("policy", POLICIES)
def test_variable_length_layer_normalization_matches_float64(policy):
    keras.config.set_dtype_policy(policy)
    compute = keras.config.dtype_policy().compute_dtype
    layer = layers.LayerNormalization()
    layer.build((None, None, FEATURES))
    rng = np.random.default_rng(0)
    layer.gamma.assign(rng.normal(1.0, 0.3, FEATURES))
    layer.beta.assign(rng.normal(0.0, 0.3, FEATURES))
    step = _graph_step(layer, compute, weights=(layer.gamma, layer.beta))
    graph = step.get_concrete_function().graph
    assert "Pad" in {op.type for op in graph.get_operations()}  # bucketed path
    gamma, beta = np.asarray(layer.gamma, "float64"), np.asarray(layer.beta, "float64")
    for length in (3, 7, 11):  # 6, 14 and 22 rows: padded to 6, 16 and 24
        x = tf.cast(rng.normal(1000.0, 1.0, (2, length, FEATURES)), compute)
        upstream = tf.cast(rng.normal(0.0, 1.0, (2, length, FEATURES)), compute)
        outputs, grads = step(x, upstream)
        assert outputs.shape == (2, length, FEATURES) and outputs.dtype == compute
        expected = _reference(
            np.asarray(tf.cast(x, "float64")),
            np.asarray(tf.cast(upstream, "float64")),
            gamma,
            beta,
        )
        for actual, wanted in zip((outputs, *grads), expected, strict=True):
            actual = np.asarray(tf.cast(actual, "float64"))
            scale = np.abs(wanted).max()
            np.testing.assert_allclose(actual, wanted, atol=TOLERANCE[compute] * scale)


def test_fixed_feature_shapes_with_unknown_batch_are_not_padded():
    layer = layers.LayerNormalization()
    layer.build((None, 5, FEATURES))
    spec = tf.TensorSpec((None, 5, FEATURES), "float32")
    graph = tf.function(layer).get_concrete_function(spec).graph
    assert "Pad" not in {op.type for op in graph.get_operations()}


_FIT_SCRIPT = textwrap.dedent(
    """
    import numpy as np, tensorflow as tf, keras
    from keras_amp_plus import layers
    inputs = keras.Input((None, 8))
    hidden = layers.LayerNormalization()(keras.layers.Dense(8)(inputs))
    outputs = layers.Swish(trainable_beta=True)(hidden)
    model = keras.Model(inputs, outputs)
    model.compile("sgd", "mse")
    def batches():
        for length in range(3, 43, 2):  # 20 lengths, 6..82 rows
            x = np.ones((2, length, 8), "float32") * np.arange(8, dtype="float32")
            yield x, x
    spec = tf.TensorSpec((None, None, 8))
    model.fit(tf.data.Dataset.from_generator(batches, output_signature=(spec, spec)),
              verbose=0)
    """
)


def test_fit_on_variable_lengths_compiles_a_bounded_number_of_kernels(tmp_path):
    dump = tmp_path / "xla"
    env = {
        **os.environ,
        "XLA_FLAGS": f"--xla_dump_to={dump}",
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "KERAS_BACKEND": "tensorflow",
    }
    completed = subprocess.run(
        [sys.executable, "-c", _FIT_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    rows = np.arange(3, 43, 2) * 2
    for kernel, sizes in (("normalize", rows), ("swish", rows * 8)):
        compiled = len(list(dump.glob(f"*_{kernel}_*before_optimizations.txt")))
        buckets = len(set(np.asarray(_row_buckets.bucket_rows(sizes)).tolist()))
        assert compiled > 0, f"no {kernel} kernel was compiled at all"
        # A forward and a backward kernel per bucket, not per length (20).
        assert compiled <= 2 * buckets < 2 * len(rows), kernel


def _swish_reference(x, upstream, beta):
    sigmoid = 1 / (1 + np.exp(-beta * x))
    x_grad = upstream * sigmoid * (1 + beta * x * (1 - sigmoid))
    beta_grad = (upstream * x**2 * sigmoid * (1 - sigmoid)).sum()
    return x * sigmoid, x_grad, beta_grad


@pytest.mark.parametrize("policy", POLICIES)
def test_variable_length_swish_matches_float64(policy):
    keras.config.set_dtype_policy(policy)
    compute = keras.config.dtype_policy().compute_dtype
    layer = layers.Swish(beta=1.5, trainable_beta=True)
    layer.build((None, None, FEATURES))
    spec = tf.TensorSpec((None, None, FEATURES), compute)

    @tf.function(input_signature=[spec, spec])
    def step(x, upstream):
        with tf.GradientTape() as tape:
            tape.watch(x)
            outputs = layer(x)
        grads = tape.gradient(outputs, [x, layer.beta], output_gradients=upstream)
        return outputs, grads

    graph = step.get_concrete_function().graph
    assert "Pad" in {op.type for op in graph.get_operations()}  # bucketed path
    rng = np.random.default_rng(0)
    for length in (3, 5):  # 96 and 160 elements: padded to 96 and 192
        x = tf.cast(rng.normal(0.0, 4.0, (2, length, FEATURES)), compute)
        upstream = tf.cast(rng.normal(0.0, 1.0, (2, length, FEATURES)), compute)
        outputs, grads = step(x, upstream)
        assert outputs.shape == (2, length, FEATURES) and outputs.dtype == compute
        expected = _swish_reference(
            np.asarray(tf.cast(x, "float64")),
            np.asarray(tf.cast(upstream, "float64")),
            1.5,
        )
        for actual, wanted in zip((outputs, *grads), expected, strict=True):
            actual = np.asarray(tf.cast(actual, "float64"))
            scale = np.abs(wanted).max()
            np.testing.assert_allclose(actual, wanted, atol=TOLERANCE[compute] * scale)


@pytest.mark.parametrize("policy", POLICIES)
def test_variable_length_swish_with_fixed_beta_matches_float64(policy):
    # beta 1: in bfloat16 and float32 with oneDNN on, oneDNN's swish runs the
    # forward pass unpadded and the backward pass pads what it needs itself.
    keras.config.set_dtype_policy(policy)
    compute = keras.config.dtype_policy().compute_dtype
    step = _graph_step(layers.Swish(), compute)
    rng = np.random.default_rng(1)
    for length in (3, 4, 5, 4):  # 96, 128, 160, 128 elements; 128 again
        x = tf.cast(rng.normal(0.0, 4.0, (2, length, FEATURES)), compute)
        upstream = tf.cast(rng.normal(0.0, 1.0, (2, length, FEATURES)), compute)
        outputs, (x_grad,) = step(x, upstream)
        assert outputs.shape == x.shape and x_grad.shape == x.shape
        assert outputs.dtype == compute and x_grad.dtype == compute
        expected = _swish_reference(
            np.asarray(tf.cast(x, "float64")),
            np.asarray(tf.cast(upstream, "float64")),
            1.0,
        )[:2]
        for actual, wanted in zip((outputs, x_grad), expected, strict=True):
            actual = np.asarray(tf.cast(actual, "float64"))
            scale = np.abs(wanted).max()
            np.testing.assert_allclose(actual, wanted, atol=TOLERANCE[compute] * scale)


@pytest.mark.onednn  # oneDNN's fused swish (see conftest.py)
@pytest.mark.parametrize("policy", ("float32", "mixed_bfloat16"))
def test_variable_length_swish_inference_pays_no_padding(policy):
    keras.config.set_dtype_policy(policy)
    compute = keras.config.dtype_policy().compute_dtype
    layer = layers.Swish()
    inference = _graph_step(layer, compute, with_gradients=False)
    training = _graph_step(layer, compute)
    ops = {op.type for op in inference.get_concrete_function().graph.get_operations()}
    # The forward pass is the pair grappler's remapper fuses into oneDNN's
    # swish, on the input itself: no padding where no gradient is taken.
    assert "Pad" not in ops and {"Sigmoid", "Mul"} <= ops
    ops = {op.type for op in training.get_concrete_function().graph.get_operations()}
    assert "Pad" in ops  # the backward pass's XLA kernel is bucketed


def test_variable_length_float16_swish_pads_in_the_forward_pass():
    # No oneDNN swish for float16: its forward pass is the bucketed XLA kernel.
    layer = layers.Swish(dtype="mixed_float16")
    inference = _graph_step(layer, "float16", with_gradients=False)
    ops = {op.type for op in inference.get_concrete_function().graph.get_operations()}
    assert "Pad" in ops


def test_variable_length_layer_normalization_differentiates_twice_like_float64():
    # A gradient penalty of a loss through the padded rows: the loss's
    # gradient depends on x, so the slice's gradient (a pad) is differentiated
    # again; a gradient that stopped there would leave out that term.
    keras.config.set_dtype_policy("float32")
    layer = layers.LayerNormalization()
    layer.build((None, None, 4))
    set_random_weights(layer)
    spec = tf.TensorSpec((None, None, 4), tf.float32)
    step = tf.function(lambda x: layer(x), input_signature=[spec])
    graph = step.get_concrete_function().graph
    assert "Pad" in {op.type for op in graph.get_operations()}  # bucketed path
    gamma = np.reshape(as_float64(layer.gamma), (1, 1, 4))
    beta = np.reshape(as_float64(layer.beta), (1, 1, 4))
    x, _, x64, _ = float_inputs((2, 5, 4), 0.0, tf.float32)  # 10 rows, padded to 12
    direction = tf.random.stateless_normal(x.shape, (1, 2))
    with tf.GradientTape() as outer:
        outer.watch(x)
        with tf.GradientTape() as inner:
            inner.watch(x)
            loss = tf.reduce_sum(tf.sin(3.0 * step(x)))
        x_grad = inner.gradient(loss, x)
        penalty = tf.reduce_sum(x_grad * direction)
    second = outer.gradient(penalty, x)

    def loss_gradient(outputs):
        return 3.0 * np.cos(3.0 * outputs)

    outputs64 = normalization_reference(x64, 0 * x64, gamma, beta, 1e-3, (2,))[0]
    ref = normalization_reference(
        x64, loss_gradient(outputs64), gamma, beta, 1e-3, (2,)
    )
    np.testing.assert_allclose(as_float64(x_grad), ref[1], rtol=1e-4, atol=1e-5)
    expected = second_order_reference(
        x64, loss_gradient, as_float64(direction), gamma, beta, (2,)
    )
    atol = 1e-3 * np.abs(expected).max()
    np.testing.assert_allclose(as_float64(second), expected, rtol=1e-3, atol=atol)


@pytest.mark.parametrize("layer", (layers.Swish, layers.LayerNormalization))
def test_an_empty_sequence_of_varying_length_steps_through(layer):
    # A batch of zero-length sequences pads to one element and slices back.
    layer = layer()
    layer.build((None, None, FEATURES))
    step = _graph_step(layer, "float32", weights=layer.trainable_weights)
    x = tf.zeros((2, 0, FEATURES))
    outputs, (x_grad, *weight_grads) = step(x, x)
    assert outputs.shape == x_grad.shape == (2, 0, FEATURES)
    for grad in weight_grads:  # nothing flows from no rows
        np.testing.assert_array_equal(np.asarray(grad), 0.0)


_EAGER_SCRIPT = """
import json
import numpy as np
import tensorflow as tf
from keras_amp_plus import layers
from keras_amp_plus.layers import _fused_normalization, _swish_activation

norm, swish = layers.LayerNormalization(), layers.Swish()
instance_norm = layers.InstanceNormalization()
kernels = (_fused_normalization._normalize_forward, _swish_activation._swish_forward)
rng = np.random.default_rng(0)


def standardized(x64, axes):
    mean = x64.mean(axes, keepdims=True)
    return (x64 - mean) / np.sqrt(x64.var(axes, keepdims=True) + 1e-3)


def largest_errors(length):
    x = rng.normal(size=(2, length, 8)).astype("float32")
    image = rng.normal(size=(1, length, length + 1, 4)).astype("float32")
    x64 = x.astype(np.float64)
    with tf.GradientTape() as tape:
        tensor = tf.constant(x)
        tape.watch(tensor)
        swished = swish(tensor)
    swish_grad = tape.gradient(swished, tensor)
    sigmoid = 1 / (1 + np.exp(-x64))
    expected = {
        "norm": (norm(x), standardized(x64, -1)),
        "instance_norm": (
            instance_norm(image),
            standardized(image.astype(np.float64), (1, 2)),
        ),
        "swish": (swished, x64 * sigmoid),
        "swish_grad": (swish_grad, sigmoid * (1 + x64 * (1 - sigmoid))),
    }
    return {k: float(np.abs(np.asarray(a) - b).max()) for k, (a, b) in expected.items()}


result = {}
for attempt in ("first", "again", "third"):
    errors = [largest_errors(length) for length in range(1, 21)]
    result[attempt] = {
        "traced": [kernel.experimental_get_tracing_count() for kernel in kernels],
        "largest": {k: max(e[k] for e in errors) for k in errors[0]},
    }
print(json.dumps(result))
"""


def test_eager_calls_compile_no_kernel():
    # A decoding loop or a notebook's `model(image)` called eagerly, at new
    # shapes or again at one, runs plain ops, compiling nothing (in a process
    # of its own: the kernels' trace counts are process-wide).
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "KERAS_BACKEND": "tensorflow"}
    env.pop("KERAS_AMP_PLUS_NORMALIZATION_PATH", None)
    completed = subprocess.run(
        [sys.executable, "-c", _EAGER_SCRIPT],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(completed.stdout.strip().splitlines()[-1])
    for attempt in result.values():
        assert max(attempt["largest"].values()) < 1e-5, attempt["largest"]
    for attempt in ("first", "again", "third"):
        assert result[attempt]["traced"] == [0, 0]

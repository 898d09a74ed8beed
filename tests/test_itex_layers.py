"""The layers on both stacks: numerics against float64, config and weight round trips.

Written against `_compat` only, so the same tests run in the Keras 3 suite and in
`make test-itex` (TensorFlow 2.15 + Keras 2.15 + ITEX), where LayerNormalization
runs ITEX's fused kernel.
"""

import subprocess
import sys

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import swish_reference

import keras_amp_plus as kap
from keras_amp_plus import _compat, _itex_probe
from keras_amp_plus.layers import (
    _path_choice,
    _per_sample_batch_norm,
    _swish_activation,
    _swish_calibration,
)

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
# One rounding of the output per dtype, plus float32 arithmetic slop relative to
# the largest value (scaled by how far N(mean, 1) inputs sit from zero).
ROUNDING = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
FLOAT32_SLOP = 2.0**-20


def f64(tensor):
    return np.asarray(tf.cast(tensor, tf.float64))


def assert_close(actual, expected, dtype, what, slop_scale=1.0):
    actual = f64(actual)
    tolerance = ROUNDING[dtype] * np.abs(expected) + (
        FLOAT32_SLOP * slop_scale * np.abs(expected).max()
    )
    error = np.abs(actual - expected)
    assert np.all(error <= tolerance), (
        f"{what}: max error {error.max():.3g}, tolerance {tolerance.min():.3g}"
    )


def inputs(shape, mean, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(mean, 1.0, shape).astype("float32")
    upstream = rng.normal(0.0, 1.0, shape).astype("float32")
    return x, upstream


def normalization_reference(x, upstream, gamma, beta, epsilon, axes):
    """Output and gradients (x, gamma, beta) of a normalization, in float64.

    `gamma`/`beta` broadcast against `x`; `upstream` is the gradient reaching
    the output (in the compute dtype, as the layer sees it).
    """
    x = x.astype("float64")
    mean = x.mean(axis=axes, keepdims=True)
    centered = x - mean
    inverse_stddev = 1.0 / np.sqrt(
        (centered**2).mean(axis=axes, keepdims=True) + epsilon
    )
    normalized = centered * inverse_stddev
    outputs = normalized * gamma + beta
    scaled = upstream * gamma
    x_grad = inverse_stddev * (
        scaled
        - scaled.mean(axis=axes, keepdims=True)
        - normalized * (scaled * normalized).mean(axis=axes, keepdims=True)
    )
    param_axes = tuple(i for i in range(x.ndim) if np.shape(gamma)[i] == 1)
    gamma_grad = (upstream * normalized).sum(axis=param_axes)
    beta_grad = upstream.sum(axis=param_axes)
    return outputs, x_grad, gamma_grad, beta_grad


def rounded(values, dtype):
    """Return `values` rounded to `dtype`, as float64."""
    return f64(tf.cast(tf.constant(values), dtype))


def forward_backward(layer, x, upstream):
    x = tf.convert_to_tensor(x)
    with tf.GradientTape() as tape:
        tape.watch(x)
        outputs = layer(x)
        loss = tf.reduce_sum(tf.cast(outputs, tf.float32) * upstream)
    grads = tape.gradient(loss, [x, *layer.trainable_weights])
    return outputs, grads


def set_random_weights(layer, seed=1):
    rng = np.random.default_rng(seed)
    layer.set_weights(
        [1.0 + 0.1 * rng.normal(size=w.shape).astype("float32") for w in layer.weights]
    )


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("mean", (0.0, 1000.0))
@pytest.mark.parametrize("inputs_in", ("float32", "compute dtype"))
def test_layer_normalization_matches_float64(policy, mean, inputs_in):
    x, upstream = inputs((16, 64), mean)
    compute = _compat.dtype_policy(policy).compute_dtype
    if inputs_in == "compute dtype":  # as a preceding mixed-precision layer feeds it
        x = tf.cast(x, compute)
    layer = kap.layers.LayerNormalization(dtype=policy)
    layer.build(x.shape)
    set_random_weights(layer)
    gamma, beta = (w.numpy().astype("float64").reshape(1, -1) for w in layer.weights)
    outputs, (x_grad, gamma_grad, beta_grad) = forward_backward(layer, x, upstream)
    x = f64(x)
    reference = normalization_reference(
        x, rounded(upstream, compute), gamma, beta, 1e-3, (1,)
    )

    assert _compat.standardize_dtype(outputs.dtype) == compute
    assert [_compat.standardize_dtype(w.dtype) for w in layer.weights] == [
        "float32",
        "float32",
    ]
    scale = 1.0 + abs(mean)
    assert_close(outputs, reference[0], compute, "outputs", slop_scale=scale)
    # The input gradient comes back in the compute dtype: one rounding.
    assert_close(x_grad, reference[1], compute, "x gradient", slop_scale=scale)
    assert_close(gamma_grad, reference[2], "float32", "gamma gradient", scale)
    assert_close(beta_grad, reference[3], "float32", "beta gradient", scale)


def itex_layer_norms(layer, spec):
    """Return the ITEXLayerNorm ops of `layer` traced for `spec`."""
    graph = tf.function(layer).get_concrete_function(spec).graph
    return [op for op in graph.get_operations() if op.type == "ITEXLayerNorm"]


@pytest.mark.itex
def test_layer_normalization_runs_itex_fused_kernel():
    layer = kap.layers.LayerNormalization()
    (norm,) = itex_layer_norms(layer, tf.TensorSpec((None, 8, 32)))
    assert norm.get_attr("T") == tf.float32 and norm.get_attr("U") == tf.float32
    # A normalization over two axes is not ITEX's kernel: our XLA kernel runs.
    two_axes = kap.layers.LayerNormalization(axis=(1, 2))
    assert not itex_layer_norms(two_axes, tf.TensorSpec((2, 8, 32)))


@pytest.mark.itex
@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
def test_half_precision_takes_itex_kernel_where_the_probe_found_it_runs(dtype):
    status = _itex_probe.itex_layer_norm_status(dtype)
    layer = kap.layers.LayerNormalization(dtype=f"mixed_{dtype}")
    norms = itex_layer_norms(layer, tf.TensorSpec((None, 8, 32), dtype))
    assert bool(norms) == status["works"], status["reason"]
    for norm in norms:
        assert norm.get_attr("T") == tf.as_dtype(dtype)  # the compute dtype
        assert norm.get_attr("U") == tf.float32  # statistics and gamma/beta


STEPS = ("eager", "per_sample", "per_sample_any_batch", "per_sample_any_image_size")


@pytest.mark.parametrize("step", (*STEPS, "any_image_size"))
@pytest.mark.parametrize("policy", POLICIES)
def test_instance_normalization_matches_float64(policy, step, monkeypatch):
    # Per sample: TensorFlow's batch-norm kernel once per sample in a graph
    # step, unrolled for a known batch size, a while loop for any (batch or
    # image size). Any image size unforced: the run-time switch by size.
    if step.startswith("per_sample"):
        path = _path_choice.PER_SAMPLE_BATCH_NORM
        monkeypatch.setenv(_path_choice.PATH_VARIABLE, path)
        monkeypatch.setattr(_per_sample_batch_norm, "MIN_SAMPLE_ELEMENTS", 1)
    x, upstream = inputs((2, 6, 5, 8), 10.0)
    layer = kap.layers.InstanceNormalization(dtype=policy)
    layer.build(x.shape)
    set_random_weights(layer)
    gamma, beta = (
        w.numpy().astype("float64").reshape(1, 1, 1, -1) for w in layer.weights
    )

    def run(x, upstream):
        return forward_backward(layer, x, upstream)

    if step != "eager":
        shape = (None, *x.shape[1:]) if step.endswith("any_batch") else x.shape
        if step.endswith("any_image_size"):
            shape = (None, None, None, x.shape[-1])
        spec = tf.TensorSpec(shape, tf.float32)
        run = tf.function(run, input_signature=[spec, spec])
        graph = run.get_concrete_function().graph.as_graph_def()
        ops = [n.op for n in graph.node]
        ops += [n.op for f in graph.library.function for n in f.node_def]
        if step.startswith("per_sample"):
            assert ops.count("FusedBatchNormV3") == (1 if shape[0] is None else 2)
        else:
            assert "Case" in ops or "StatelessCase" in ops
    outputs, (x_grad, gamma_grad, beta_grad) = run(x, upstream)
    compute = _compat.dtype_policy(policy).compute_dtype
    reference = normalization_reference(
        x, rounded(upstream, compute), gamma, beta, 1e-3, (1, 2)
    )
    assert _compat.standardize_dtype(outputs.dtype) == compute
    assert_close(outputs, reference[0], compute, "outputs", slop_scale=11.0)
    assert_close(x_grad, reference[1], compute, "x gradient", slop_scale=11.0)
    assert_close(gamma_grad, reference[2].reshape(-1), "float32", "gamma", 11.0)
    assert_close(beta_grad, reference[3].reshape(-1), "float32", "beta", 11.0)


@pytest.mark.parametrize("policy", POLICIES)
def test_swish_matches_float64(policy):
    x, upstream = inputs((8, 32), 0.0)
    layer = kap.layers.Swish(beta=1.5, trainable_beta=True, dtype=policy)
    outputs, grads = forward_backward(layer, 4.0 * x, upstream)
    check_swish(outputs, grads, 4.0 * x, upstream, layer)


def test_the_swish_function_builds_a_functional_model_that_reloads(tmp_path):
    # On Keras 2, TF ops applied to a KerasTensor are wrapped by tf.keras,
    # but not a custom gradient: this raised a TypeError there.
    inputs = keras.Input((6,))
    model = keras.Model(inputs, kap.layers.swish(inputs, beta=1.5))
    x = np.linspace(-5.0, 5.0, 12, dtype="float32").reshape(2, 6)
    x64 = x.astype(np.float64)
    expected = swish_reference(x64, np.ones_like(x64), 1.5)[0]
    np.testing.assert_allclose(model.predict(x, verbose=0), expected, rtol=1e-6)
    path = str(tmp_path / "model.keras")
    model.save(path)
    reloaded = keras.models.load_model(path)
    np.testing.assert_array_equal(
        reloaded.predict(x, verbose=0), model.predict(x, verbose=0)
    )
    # Not symbolic: NumPy arrays and lists are computed at once (Keras 2's
    # `is_keras_tensor` raises for them).
    np.testing.assert_allclose(kap.layers.swish(x, beta=1.5), expected, rtol=1e-6)
    assert np.isclose(float(kap.layers.swish([1.0])[0]), 1.0 / (1.0 + np.exp(-1.0)))


def test_the_swish_function_takes_a_tensor_beta_on_tensors_only():
    x = np.linspace(-5.0, 5.0, 12)
    upstream = np.linspace(0.5, 1.5, 12)
    beta = tf.Variable(1.5)
    with tf.GradientTape() as tape:
        outputs = kap.layers.swish(tf.constant(x, "float32"), beta=beta)
        loss = tf.reduce_sum(outputs * upstream)
    expected, _, beta_grad = swish_reference(x, upstream, 1.5)
    np.testing.assert_allclose(outputs, expected, rtol=1e-6)
    np.testing.assert_allclose(tape.gradient(loss, beta), beta_grad, rtol=1e-5)
    # On Keras 2 a symbolic input builds a `Swish` layer, whose beta is a
    # number; on Keras 3 an operation, whose config (saving) needs one.
    with pytest.raises(ValueError, match=r"trainable_beta=True.*Received: beta="):
        inputs = keras.Input((6,))
        outputs = kap.layers.swish(inputs, beta=tf.constant(1.5))
        keras.Model(inputs, outputs).get_config()


@pytest.mark.parametrize("policy", POLICIES)
def test_swish_inside_xla_traced_for_any_batch_size_matches_float64(
    policy, monkeypatch
):
    # As `fit(jit_compile=True)` traces a pipeline with a partial last batch;
    # small thresholds make the larger batch recompute the sigmoid.
    monkeypatch.setattr(_compat, "onednn_enabled", lambda: False)
    small = dict.fromkeys(_swish_activation.RECOMPUTE_SIGMOID_MIN_ELEMENTS, 1024)
    monkeypatch.setattr(_swish_activation, "RECOMPUTE_SIGMOID_MIN_ELEMENTS", small)
    monkeypatch.setattr(_swish_calibration, "cached_cells", list)  # the table's
    layer = kap.layers.Swish(beta=1.5, trainable_beta=True, dtype=policy)
    layer.build((None, 32))
    spec = tf.TensorSpec((None, 32), tf.float32)

    @tf.function(jit_compile=True, input_signature=[spec, spec])
    def step(x, upstream):
        return forward_backward(layer, x, upstream)

    for batch in (8, 64):  # 256 and 2048 elements
        x, upstream = inputs((batch, 32), 0.0)
        outputs, grads = step(4.0 * x, upstream)
        check_swish(outputs, grads, 4.0 * x, upstream, layer)


@pytest.mark.parametrize("policy", POLICIES)
def test_layers_on_sequences_of_varying_length_match_float64(policy):
    # A step traced for any batch and length (text padded per batch): both
    # layers pad to size buckets where they run XLA kernels.
    spec = tf.TensorSpec((None, None, 8), tf.float32)
    norm = kap.layers.LayerNormalization(dtype=policy)
    swish = kap.layers.Swish(beta=1.5, trainable_beta=True, dtype=policy)
    norm.build((None, None, 8))
    set_random_weights(norm)
    gamma, beta = (w.numpy().astype("float64").reshape(1, 1, -1) for w in norm.weights)
    compute = _compat.dtype_policy(policy).compute_dtype

    @tf.function(input_signature=[spec, spec])
    def step(x, upstream):
        return forward_backward(norm, x, upstream), forward_backward(swish, x, upstream)

    for length in (3, 5):  # 48 and 80 elements: not sizes of one bucket
        x, upstream = inputs((2 * length, 8), 0.0)
        x, upstream = (tf.reshape(t, (2, length, 8)) for t in (x, upstream))
        (outputs, (x_grad, *_)), swish_results = step(x, upstream)
        reference = normalization_reference(
            f64(x), rounded(upstream, compute), gamma, beta, 1e-3, (2,)
        )
        assert outputs.shape == (2, length, 8)
        assert_close(outputs, reference[0], compute, "outputs")
        assert_close(x_grad, reference[1], compute, "x gradient")
        check_swish(*swish_results, x, upstream, swish)


def check_swish(outputs, grads, x, upstream, layer):
    """Check Swish's output and gradients (x, beta) against float64."""
    x_grad, beta_grad = grads
    compute = _compat.standardize_dtype(layer.compute_dtype)
    # The layer computes on its input rounded to the compute dtype.
    x64 = rounded(x, compute)
    upstream64 = rounded(upstream, compute)
    expected, x_grad64, beta_grad64 = swish_reference(x64, upstream64, 1.5)
    assert _compat.standardize_dtype(outputs.dtype) == compute
    assert _compat.standardize_dtype(layer.beta.dtype) == "float32"
    assert_close(outputs, expected, compute, "outputs", slop_scale=4.0)
    assert_close(x_grad, x_grad64, compute, "x gradient", slop_scale=4.0)
    np.testing.assert_allclose(float(beta_grad), beta_grad64, rtol=2e-2)


LAYERS = {
    "LayerNormalization": lambda: kap.layers.LayerNormalization(epsilon=1e-4),
    "InstanceNormalization": lambda: kap.layers.InstanceNormalization(center=False),
    "Swish": lambda: kap.layers.Swish(beta=0.5, trainable_beta=True),
}


@pytest.mark.parametrize("name", sorted(LAYERS))
@pytest.mark.parametrize("policy", ("float32", "mixed_bfloat16"))
def test_config_and_weights_round_trip_through_a_keras_file(name, policy, tmp_path):
    _compat.set_global_policy(policy)
    keras.utils.set_random_seed(0)
    inputs_ = keras.Input((4, 4, 3))
    outputs = LAYERS[name]()(inputs_)
    model = keras.Model(inputs_, outputs)
    layer = model.layers[-1]
    set_random_weights(layer)
    config = layer.get_config()
    clone = type(layer).from_config(config)
    assert clone.get_config() == config
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    loaded_layer = loaded.layers[-1]
    assert type(loaded_layer) is type(layer)
    assert loaded_layer.get_config() == config
    for saved, restored in zip(layer.weights, loaded_layer.weights, strict=True):
        np.testing.assert_array_equal(saved.numpy(), restored.numpy())
    x = np.random.default_rng(0).normal(size=(2, 4, 4, 3)).astype("float32")
    np.testing.assert_array_equal(
        f64(model(x)), f64(loaded(x)), err_msg=f"{name} under {policy}"
    )


def test_a_saved_model_loads_after_importing_only_the_package(tmp_path):
    """`import keras_amp_plus` registers the layers and the scaler for loading."""
    inputs = keras.Input((4, 4, 3))
    h = kap.layers.InstanceNormalization()(inputs)
    h = kap.layers.Swish(trainable_beta=True)(keras.layers.Flatten()(h))
    h = kap.layers.LayerNormalization()(
        keras.layers.Dense(8, activation=kap.layers.swish)(h)
    )
    model = keras.Model(inputs, h)
    model.compile(kap.optimizers.LossScaleOptimizer(keras.optimizers.SGD()), "mse")
    x = np.random.default_rng(0).normal(size=(2, 4, 4, 3)).astype("float32")
    model.fit(x, np.zeros((2, 8), "float32"), verbose=0)
    path = str(tmp_path / "model.keras")
    model.save(path)
    script = (
        "import sys, keras, keras_amp_plus\n"
        "model = keras.saving.load_model(sys.argv[1])\n"
        "print(type(model.optimizer).__module__.split('.')[0],"
        " [type(layer).__name__ for layer in model.layers])\n"
    )
    completed = subprocess.run(
        [sys.executable, "-c", script, path],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    assert completed.stdout.split("\n")[-2] == (
        "keras_amp_plus ['InputLayer', 'InstanceNormalization', 'Flatten', "
        "'Swish', 'Dense', 'LayerNormalization']"
    )


def test_a_reloaded_model_names_the_layers_weights_after_them(tmp_path):
    # Keras 2 builds a custom layer reloaded from a `.keras` file outside its
    # name scope ("gamma:0" for every one): the scaler's records and the
    # monitor's attribution go by these names.
    inputs = keras.Input((8,))
    hidden = kap.layers.LayerNormalization(name="ln1")(inputs)
    hidden = kap.layers.LayerNormalization(name="ln2")(hidden)
    hidden = kap.layers.Swish(name="sw", trainable_beta=True)(hidden)
    images = keras.layers.Reshape((2, 4, 1))(hidden)
    outputs = kap.layers.InstanceNormalization(name="in1")(images)
    model = keras.Model(inputs, outputs)
    model.save(str(tmp_path / "model.keras"))
    reloaded = keras.models.load_model(str(tmp_path / "model.keras"))
    paths = [_compat.variable_path(variable) for variable in reloaded.weights]
    assert paths == [_compat.variable_path(variable) for variable in model.weights]
    assert paths == [
        "ln1/gamma",
        "ln1/beta",
        "ln2/gamma",
        "ln2/beta",
        "sw/beta",
        "in1/gamma",
        "in1/beta",
    ]

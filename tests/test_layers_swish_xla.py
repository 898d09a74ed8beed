"""Swish inside a model XLA compiles whole: numerics and the kept sigmoid."""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import (
    POLICIES,
    as_float64,
    check_swish,
    float_inputs,
    hlo_without_names,
    swish_reference,
    use_policy,
    xla_step,
)

from keras_amp_plus import _compat, layers
from keras_amp_plus.layers import _precision, _swish_activation, _swish_calibration

SHAPE = (64, 32)


@pytest.fixture(autouse=True)
def _float16_arithmetic(monkeypatch):
    """A CPU with float16 arithmetic: float16 runs Keras's float16 formula.

    Tests of CPUs without it say so; this keeps the rest CPU-independent.
    """
    monkeypatch.setattr(_precision, "cpu_has_float16_arithmetic", lambda: True)


def _without_float16_arithmetic(monkeypatch):
    monkeypatch.setattr(_precision, "cpu_has_float16_arithmetic", lambda: False)


def _xla_step(layer, input_signature=None):
    return xla_step(layer, SHAPE, input_signature)


def _any_batch_size(dtype):
    # As `fit` traces a `tf.data` pipeline batched without `drop_remainder`.
    spec = tf.TensorSpec((None, *SHAPE[1:]), dtype)
    return [spec, spec]


def _force_onednn(monkeypatch, onednn):
    monkeypatch.setattr(_compat, "onednn_enabled", lambda: onednn)
    # Small enough that the test's input counts as large.
    small = dict.fromkeys(_swish_activation.RECOMPUTE_SIGMOID_MIN_ELEMENTS, 1024)
    monkeypatch.setattr(_swish_activation, "RECOMPUTE_SIGMOID_MIN_ELEMENTS", small)
    monkeypatch.setattr(_swish_calibration, "cached_cells", list)  # the table's


@pytest.mark.parametrize("any_batch", (False, True))
@pytest.mark.parametrize("onednn", (True, False))
@pytest.mark.parametrize("trainable_beta", (False, True))
@pytest.mark.parametrize("policy_name", POLICIES)
def test_swish_inside_xla_matches_float64(
    policy_name, trainable_beta, onednn, any_batch, monkeypatch
):
    _force_onednn(monkeypatch, onednn)
    _check_swish_inside_xla(policy_name, trainable_beta, any_batch)


@pytest.mark.parametrize("any_batch", (False, True))
@pytest.mark.parametrize("trainable_beta", (False, True))
def test_float16_swish_without_float16_arithmetic_is_rounded_once(
    trainable_beta, any_batch, monkeypatch
):
    # Widened to float32 there, as bfloat16: as close to float64 as one
    # float16 rounding allows, in both sigmoid choices.
    _force_onednn(monkeypatch, False)
    _without_float16_arithmetic(monkeypatch)
    _check_swish_inside_xla("mixed_float16", trainable_beta, any_batch, native=False)


def _check_swish_inside_xla(policy_name, trainable_beta, any_batch, native=True):
    compute = use_policy(policy_name).compute_dtype
    layer = layers.Swish(beta=1.5, trainable_beta=trainable_beta)
    step = _xla_step(layer, _any_batch_size(compute) if any_batch else None)
    # Traced for any batch size, a small and a large batch take both choices.
    for batch in (16, SHAPE[0]) if any_batch else (SHAPE[0],):
        x, upstream, _, upstream64 = float_inputs((batch, SHAPE[1]), 0.0, compute)
        x = x * 4.0  # into both tails of the sigmoid
        outputs, grads = step(x, upstream)
        if native and compute == "float16" and not trainable_beta:
            _check_keras_float16_formula(outputs, grads[0], x, upstream64)
            continue
        check_swish(outputs, grads, x, upstream64, 1.5, compute, trainable_beta)


def _check_keras_float16_formula(outputs, x_grad, x, upstream64):
    # Keras's float16 arithmetic there: a few float16 roundings.
    outputs64, x_grad64, _ = swish_reference(as_float64(x), upstream64, 1.5)
    assert outputs.dtype == "float16" and x_grad.dtype == "float16"
    for actual, expected in ((outputs, outputs64), (x_grad, x_grad64)):
        error = np.abs(as_float64(actual) - expected)
        scale = np.abs(expected) + np.abs(expected).max() / 64
        worst = float((error / scale).max() / 2.0**-11)
        assert worst <= 12, f"{worst:.2f} float16 roundings"


def _optimized_hlo(layer, dtype, shape=SHAPE, any_batch=False):
    x, upstream, _, _ = float_inputs(shape, 0.0, dtype)
    signature = _any_batch_size(dtype) if any_batch else None
    step = _xla_step(layer, signature)
    return step.experimental_get_compiler_ir(x, upstream)("optimized_hlo")


def _exponentials_in_compiled_step(layer, dtype, shape=SHAPE, any_batch=False):
    return _optimized_hlo(layer, dtype, shape, any_batch).count(" exponential(")


@pytest.mark.parametrize("any_batch", (False, True))
def test_float16_keeps_the_sigmoid_as_keras_own_program_does(any_batch, monkeypatch):
    # float16 with float16 arithmetic compiles to exactly the program of
    # Keras's `Activation("swish")`: no slower, by construction.
    monkeypatch.setattr(_compat, "onednn_enabled", lambda: False)
    compute = use_policy("mixed_float16").compute_dtype
    ours = _optimized_hlo(layers.Swish(), compute, any_batch=any_batch)
    keras_own = _optimized_hlo(
        keras.layers.Activation("swish"), compute, any_batch=any_batch
    )
    assert hlo_without_names(ours) == hlo_without_names(keras_own)


def _tensors_written(hlo):
    """Return how many input-sized tensors the compiled step's entry writes."""
    entry = hlo[hlo.index("ENTRY") :].splitlines()
    return sum(
        f"[{SHAPE[0]},{SHAPE[1]}]" in line and " fusion(" in line for line in entry
    )


@pytest.mark.parametrize("any_batch", (False, True))
def test_float32_reads_the_sigmoid_off_its_output(any_batch, monkeypatch):
    # Below the threshold a float32 backward pass divides the output (which
    # the next layer reads anyway) by the input: the step writes its two
    # results only, with one exponential. Keras's program also writes the
    # sigmoid it keeps between the passes.
    monkeypatch.setattr(_compat, "onednn_enabled", lambda: False)
    use_policy("float32")
    ours = _optimized_hlo(layers.Swish(), "float32", any_batch=any_batch)
    keras_own = _optimized_hlo(
        keras.layers.Activation("swish"), "float32", any_batch=any_batch
    )
    assert ours.count(" exponential(") == 1
    assert _tensors_written(ours) == 2
    assert _tensors_written(keras_own) == 3


# Zero, subnormal and tiny inputs (the sigmoid is 0.5 there), both tails,
# one input whose output underflows (-200) and ordinary values.
EDGE_INPUTS = (0.0, 1e-40, -1e-40, 1e-31, -1e-29, 1e-3, -88.0, -100.0, -200.0)
EDGE_INPUTS += (30.0, 90.0, -1.2785, 2.5, -3.0)


@pytest.mark.parametrize("beta", (1.0, 1.5, -0.7))
@pytest.mark.parametrize("dtype", ("float32", "float64"))
def test_the_sigmoid_read_off_the_output_matches_float64_at_the_edges(dtype, beta):
    layer = layers.Swish(beta=beta, trainable_beta=True, dtype=dtype)
    shape = (1, len(EDGE_INPUTS))
    step = xla_step(layer, shape)
    x64 = np.array([EDGE_INPUTS])
    upstream64 = np.linspace(0.5, 1.5, len(EDGE_INPUTS))[None]
    x, upstream = tf.constant(x64, dtype), tf.constant(upstream64, dtype)
    outputs, (x_grad, beta_grad) = step(x, upstream)
    hlo = step.experimental_get_compiler_ir(x, upstream)("optimized_hlo")
    assert hlo.count(" exponential(") == 1  # the output's: none recomputed
    beta64 = float(np.float32(beta))  # the float32 weight's value
    outputs64, x_grad64, beta_grad64 = swish_reference(
        as_float64(x), upstream64, beta64
    )
    # Float32 arithmetic: the sigmoid's far tail scales the rounding of its
    # argument by that argument (up to 63 here), the slope's zero (-1.2785)
    # cancels terms of about 1, and in float32 XLA flushes a subnormal
    # sigmoid (at -88) to zero, as in Keras's program.
    for actual, expected in ((outputs, outputs64), (x_grad, x_grad64)):
        atol = 1e-7 * np.abs(expected).max() + (1e-35 if dtype == "float32" else 0)
        np.testing.assert_allclose(as_float64(actual), expected, rtol=1e-5, atol=atol)
    np.testing.assert_allclose(as_float64(beta_grad), beta_grad64, rtol=1e-5)


@pytest.mark.parametrize(
    ("policy_name", "onednn", "recomputed"),
    (
        ("float32", True, True),
        ("float32", False, True),
        ("mixed_bfloat16", True, False),
        ("mixed_bfloat16", False, True),
    ),
)
def test_backward_pass_recomputes_the_sigmoid_where_keeping_it_cost_more(
    policy_name, onednn, recomputed, monkeypatch
):
    # A kept sigmoid is computed once, by the forward pass, and read back by
    # the backward one; a recomputed one is computed in each pass.
    _force_onednn(monkeypatch, onednn)
    compute = use_policy(policy_name).compute_dtype
    exponentials = _exponentials_in_compiled_step(layers.Swish(), compute)
    assert exponentials == (2 if recomputed else 1)


def test_float16_without_float16_arithmetic_recomputes_the_sigmoid_widened(
    monkeypatch,
):
    # The widened arithmetic of bfloat16 and float32, not Keras's float16
    # formula (which keeps a float16 sigmoid: one exponential, no float32).
    _force_onednn(monkeypatch, True)
    _without_float16_arithmetic(monkeypatch)
    use_policy("mixed_float16")
    hlo = _optimized_hlo(layers.Swish(), "float16")
    assert hlo.count(" exponential(") == 2
    assert "f32[" in hlo


@pytest.mark.parametrize("policy_name", ("float32", "mixed_bfloat16"))
def test_small_inputs_keep_the_sigmoid(policy_name, monkeypatch):
    # Below the thresholds the extra exponential costs more than it saves.
    monkeypatch.setattr(_compat, "onednn_enabled", lambda: False)
    compute = use_policy(policy_name).compute_dtype
    assert _exponentials_in_compiled_step(layers.Swish(), compute) == 1


@pytest.mark.parametrize(
    ("policy_name", "onednn", "batch", "exponentials"),
    (
        ("float32", True, SHAPE[0], 2),
        ("float32", True, 16, 1),
        ("mixed_bfloat16", False, SHAPE[0], 2),
        ("mixed_bfloat16", False, 16, 1),
        ("mixed_bfloat16", True, SHAPE[0], 1),
        ("mixed_float16", False, SHAPE[0], 1),
        ("emulated_float16", False, SHAPE[0], 2),
        ("emulated_float16", False, 16, 1),
    ),
)
def test_a_step_traced_for_any_batch_size_chooses_by_the_compiled_size(
    policy_name, onednn, batch, exponentials, monkeypatch
):
    # XLA compiles each batch size with its size known and folds the choice.
    _force_onednn(monkeypatch, onednn)
    if policy_name == "emulated_float16":  # a CPU without float16 arithmetic
        _without_float16_arithmetic(monkeypatch)
        policy_name = "mixed_float16"
    compute = use_policy(policy_name).compute_dtype
    shape = (batch, SHAPE[1])
    count = _exponentials_in_compiled_step(
        layers.Swish(), compute, shape, any_batch=True
    )
    assert count == exponentials


def _fit_swish_model(activation, batches):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((SHAPE[1],)),
            keras.layers.Dense(SHAPE[1]),
            activation,
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", jit_compile=True)
    history = model.fit(batches, epochs=3, shuffle=False, verbose=0)
    return history.history["loss"], model.get_weights()


def _fit_ours_and_keras(policy_name):
    """Train the model with our Swish and with Keras's on a partial last batch."""
    use_policy(policy_name)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, SHAPE[1])).astype("float32")
    y = np.sin(x[:, :1])
    batches = tf.data.Dataset.from_tensor_slices((x, y)).batch(48)  # 48, 48, 4
    ours = _fit_swish_model(layers.Swish(), batches)
    theirs = _fit_swish_model(keras.layers.Activation("swish"), batches)
    assert np.isfinite(ours[0]).all() and ours[0][-1] < ours[0][0]
    return ours, theirs


def test_fit_with_jit_compile_trains_as_keras_does_through_both_choices(monkeypatch):
    # `fit(jit_compile=True)` on a pipeline with a partial last batch: the
    # full batches recompute the sigmoid, the last one keeps it. The same
    # weights trained with Keras's activation must follow the same path.
    _force_onednn(monkeypatch, False)
    ours, theirs = _fit_ours_and_keras("float32")
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-5)
    for mine, keras_weight in zip(ours[1], theirs[1], strict=True):
        np.testing.assert_allclose(mine, keras_weight, rtol=1e-4, atol=1e-6)


def test_float16_fit_with_jit_compile_without_float16_arithmetic(monkeypatch):
    # `mixed_float16` `fit(jit_compile=True)` with Keras's loss scaling where
    # the layer widens float16, through both sigmoid choices: Keras's float16
    # activation's losses and weights, to within float16 rounding (measured
    # 1.4e-4 and 4e-5 apart; with the recomputed sigmoid wrong, the
    # exponential not squared, 3.9e-3 and 2.3e-3).
    _force_onednn(monkeypatch, False)
    _without_float16_arithmetic(monkeypatch)
    ours, theirs = _fit_ours_and_keras("mixed_float16")
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-3)
    for mine, keras_weight in zip(ours[1], theirs[1], strict=True):
        np.testing.assert_allclose(mine, keras_weight, rtol=1e-3, atol=2e-4)


@pytest.mark.parametrize("trainable_beta", (False, True))
def test_a_gradient_penalty_through_the_output_read_sigmoid_matches_float64(
    trainable_beta,
):
    # The backward pass reads the forward's output: autodiff of that
    # gradient (a penalty on it) must still see the output's dependence on x.
    use_policy("float32")
    layer = layers.Swish(trainable_beta=trainable_beta)
    layer.build((4, 8))
    x = tf.constant(np.random.default_rng(0).normal(0.0, 2.0, (4, 8)), tf.float32)

    @tf.function(jit_compile=True)
    def penalty_gradient(x):
        with tf.GradientTape() as outer:
            outer.watch(x)
            with tf.GradientTape() as inner:
                inner.watch(x)
                outputs = layer(x)
            slope = inner.gradient(outputs, x)
            penalty = tf.reduce_sum(slope * slope)
        return outer.gradient(penalty, x)

    x64 = as_float64(x)
    sigmoid = 1.0 / (1.0 + np.exp(-x64))
    slope = sigmoid * (1.0 + x64 * (1.0 - sigmoid))
    curvature = sigmoid * (1.0 - sigmoid) * (2.0 + x64 * (1.0 - 2.0 * sigmoid))
    expected = 2.0 * slope * curvature
    np.testing.assert_allclose(
        as_float64(penalty_gradient(x)), expected, rtol=0, atol=1e-5
    )

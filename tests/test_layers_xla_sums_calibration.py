"""Instance norm's sums inside XLA: products or Keras's formula, as measured."""

import json

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import (
    InXlaStep,
    as_float64,
    check_normalization,
    float_inputs,
    penalty_gradients,
    second_order_reference,
    set_random_weights,
    use_policy,
)

from keras_amp_plus import layers
from keras_amp_plus.layers import _path_calibration, _xla_sums_calibration

SHAPE = (4, 16, 16, 16)  # 16384 elements
ELEMENTS = int(np.prod(SHAPE))


def _write_cells(ratios, dtype="bfloat16"):
    """Cache a measurement: the products' time over the formula's per size."""
    cells = [
        {"dtype": dtype, "shape": [size], "elements": size, "ratio": ratio}
        for size, ratio in ratios.items()
    ]
    _path_calibration.write_cells(_xla_sums_calibration.cache_path(), cells)


@pytest.mark.parametrize(
    "ratios, elements, expected",
    (
        ({2**20: 1.10}, 2**20, False),  # the products lost at this size
        ({2**20: 0.60}, 2**20, True),  # they won
        ({2**18: 0.60, 2**20: 1.10}, 2**19 + 2**17, False),  # the nearest lost
        ({2**18: 0.60, 2**20: 1.10}, 2**18 + 2**16, True),  # the nearest won
        ({2**20: 1.10}, 2**21, False),  # one octave away still stands for it
        ({2**20: 1.10}, 2**22, True),  # two do not: the default, products
        ({2**20: 1.10}, None, True),  # size unknown at trace time
    ),
)
def test_the_nearest_measured_size_decides(
    ratios, elements, expected, empty_path_cache
):
    _write_cells(ratios)
    assert _xla_sums_calibration.products_win(tf.bfloat16, elements) is expected


def test_without_a_measurement_of_the_precision_the_products_run(empty_path_cache):
    assert _xla_sums_calibration.products_win(tf.float32, 2**20)
    _write_cells({2**20: 1.5}, dtype="float16")  # another precision's
    assert _xla_sums_calibration.products_win(tf.float32, 2**20)
    assert not _xla_sums_calibration.products_win(tf.float16, 2**20)


def test_the_allocator_setting_has_its_own_cache(empty_path_cache, monkeypatch):
    # TensorFlow's unpooled allocator changes which form wins: a race run
    # under one setting must not decide under the other.
    monkeypatch.delenv(_xla_sums_calibration.ALLOCATOR_VARIABLE, raising=False)
    _write_cells({2**20: 1.5})
    assert not _xla_sums_calibration.products_win(tf.bfloat16, 2**20)
    monkeypatch.setenv(_xla_sums_calibration.ALLOCATOR_VARIABLE, "1")
    assert _xla_sums_calibration.products_win(tf.bfloat16, 2**20)


@pytest.mark.parametrize(
    "ratios",
    (
        {2**16: 0.9, 2**18: 1.1, 2**19: 0.7, 2**20: 1.2, 2**22: 0.6},
        {2**20: 1.1},
        {2**16: 1.1, 2**22: 1.1},
    ),
)
def test_the_run_time_choice_is_the_trace_time_one(ratios, empty_path_cache):
    _write_cells(ratios)
    for elements in [2**e + d for e in range(12, 26) for d in (-1, 0, 2 ** (e - 2))]:
        at_run_time = _xla_sums_calibration.products_win_at_run_time(
            tf.bfloat16, tf.constant(elements)
        )
        expected = _xla_sums_calibration.products_win(tf.bfloat16, elements)
        assert bool(at_run_time) is expected, elements


def _optimized_layer_step(policy_name, any_batch=False):
    """Return XLA's optimized HLO of the layer's forward + backward."""
    compute = use_policy(policy_name).compute_dtype
    layer = layers.InstanceNormalization()
    layer.build(SHAPE)
    x, upstream, _, _ = float_inputs(SHAPE, 0.0, compute)
    batch = None if any_batch else SHAPE[0]
    spec = tf.TensorSpec((batch, *SHAPE[1:]), compute)

    @tf.function(jit_compile=True, input_signature=[spec, spec])
    def step(x, upstream):
        with tf.GradientTape() as tape:
            tape.watch(x)
            outputs = layer(x)
        return outputs, tape.gradient(outputs, [x, *layer.trainable_weights], upstream)

    return step.experimental_get_compiler_ir(x, upstream)(stage="optimized_hlo")


def _dots_in_layer_step(policy_name, any_batch=False):
    """Return how many dots XLA compiles for the layer's forward + backward."""
    return _optimized_layer_step(policy_name, any_batch).count(" dot(")


@pytest.mark.parametrize("policy_name", ("mixed_bfloat16", "float32"))
def test_the_layer_sums_as_the_race_measured(policy_name, empty_path_cache):
    # Four per-sample sums as batched dots where the products won or nothing
    # was measured; reductions (no dot) where they lost, in that precision.
    dtype = "bfloat16" if policy_name == "mixed_bfloat16" else "float32"
    assert _dots_in_layer_step(policy_name) == 4
    _write_cells({ELEMENTS: 0.7}, dtype)
    assert _dots_in_layer_step(policy_name) == 4
    _write_cells({ELEMENTS: 1.2}, dtype)
    assert _dots_in_layer_step(policy_name) == 0


@pytest.mark.parametrize("policy_name", ("mixed_bfloat16", "float32"))
def test_traced_for_any_batch_xla_folds_the_choice_per_shape(
    policy_name, empty_path_cache
):
    # The size is known only when XLA compiles the shape: the choice between
    # the forms is folded there, leaving the measured form alone.
    dtype = "bfloat16" if policy_name == "mixed_bfloat16" else "float32"
    assert _dots_in_layer_step(policy_name, any_batch=True) == 4  # no measurement
    _write_cells({ELEMENTS: 1.2}, dtype)
    formula = _optimized_layer_step(policy_name, any_batch=True)
    assert formula.count(" dot(") == 0
    assert " select(" not in formula and " conditional(" not in formula
    _write_cells({ELEMENTS: 0.7, 4 * ELEMENTS: 1.2}, dtype)
    products = _optimized_layer_step(policy_name, any_batch=True)
    assert products.count(" dot(") == 4
    assert " select(" not in products and " conditional(" not in products


@pytest.mark.parametrize("any_batch", (False, True))
@pytest.mark.parametrize("mean", (0.0, 100.0))
@pytest.mark.parametrize("policy_name", ("float32", "mixed_bfloat16", "mixed_float16"))
def test_where_the_products_lost_the_formula_matches_float64(
    policy_name, mean, any_batch, empty_path_cache
):
    policy = use_policy(policy_name)
    _write_cells({ELEMENTS: 1.2}, policy.compute_dtype)
    layer = InXlaStep(layers.InstanceNormalization(), SHAPE, any_batch)
    check_normalization(layer, SHAPE, mean, policy, (1, 2), (1, 1, 1, 16))
    assert _dots_in_layer_step(policy_name, any_batch) == 0  # the formula ran


@pytest.mark.parametrize("products", (False, True), ids=("formula", "products"))
def test_traced_for_any_batch_differentiates_twice_like_float64(
    products, empty_path_cache
):
    # A gradient penalty through the choice XLA folds: autodiff of the
    # layer's gradient reaches the form taken, whichever it is.
    compute = use_policy("mixed_bfloat16").compute_dtype
    _write_cells({ELEMENTS: 0.7 if products else 1.2}, compute)
    layer = layers.InstanceNormalization()
    layer.build(SHAPE)
    set_random_weights(layer)
    spec = tf.TensorSpec((None, *SHAPE[1:]), compute)
    step = tf.function(lambda x: layer(x), jit_compile=True, input_signature=[spec])
    x, upstream, x64, upstream64 = float_inputs(SHAPE, 0.0, compute)
    direction = tf.cast(tf.random.stateless_normal(SHAPE, (1, 2)), compute)
    _, second = penalty_gradients(step, x, upstream, direction)
    params = (1, 1, 1, SHAPE[-1])
    gamma = np.reshape(as_float64(layer.gamma), params)
    beta = np.reshape(as_float64(layer.beta), params)
    expected = second_order_reference(
        x64, upstream64, as_float64(direction), gamma, beta, (1, 2)
    )
    atol = 5e-2 * np.abs(expected).max()  # bfloat16, as the known-shape test
    np.testing.assert_allclose(as_float64(second), expected, rtol=0, atol=atol)


def test_measure_sums_caches_ratios(empty_path_cache, monkeypatch):
    measured = _xla_sums_calibration.measure_sums(seconds=0.0)
    assert measured["cells"] == []  # no budget: nothing timed
    assert _xla_sums_calibration.cached_cells() == []
    monkeypatch.setattr(
        _xla_sums_calibration, "RACED_SHAPES", ((2, 4, 4, 8), (2, 8, 8, 8))
    )
    measured = _xla_sums_calibration.measure_sums(["bfloat16", "float32"], reps=2)
    cells = measured["cells"]
    assert [(cell["dtype"], cell["elements"]) for cell in cells] == [
        ("bfloat16", 256),
        ("float32", 256),
        ("bfloat16", 1024),
        ("float32", 1024),
    ]
    assert all(cell["ratio"] > 0 and cell["passes"] == 2 for cell in cells)
    with open(measured["path"], encoding="utf-8") as file:
        assert json.load(file)["cells"] == cells
    assert _xla_sums_calibration.cached_cells() == cells


def test_measure_sums_takes_the_geometric_mean_of_two_passes(
    empty_path_cache, monkeypatch
):
    # One pass slowed the products (1.21), the other did not (0.81): 0.99,
    # still a win.
    monkeypatch.setattr(_xla_sums_calibration, "RACED_SHAPES", ((8, 32, 32, 64),))
    ratios = iter([1.21, 0.81])
    monkeypatch.setattr(
        _xla_sums_calibration, "_products_ratio", lambda *_: next(ratios)
    )
    (cell,) = _xla_sums_calibration.measure_sums(["float32"])["cells"]
    assert cell["passes"] == 2
    assert cell["ratio"] == pytest.approx((1.21 * 0.81) ** 0.5)
    assert _xla_sums_calibration.products_win(tf.float32, cell["elements"])


def test_measure_sums_refuses_to_run_traced():
    with pytest.raises(RuntimeError, match="must run eagerly"):
        tf.function(lambda: _xla_sums_calibration.measure_sums(["float32"]))()


def _fit_cnn(normalization, dataset):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((*SHAPE[1:3], 3)),
            keras.layers.Conv2D(SHAPE[-1], 3, padding="same"),
            normalization,
            keras.layers.Activation("relu"),
            keras.layers.GlobalAveragePooling2D(),
            keras.layers.Dense(1),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.05), loss="mse", jit_compile=True)
    history = model.fit(dataset, epochs=3, shuffle=False, verbose=0)
    return history.history["loss"], model.get_weights()


@pytest.mark.parametrize(
    "cells, samples, drop_remainder",
    (
        ({ELEMENTS: 1.2}, 12, True),  # the formula
        ({ELEMENTS: 0.7}, 12, True),  # the products
        # Batches of 4 (the formula) and a last one of 2 (the products),
        # the batch size unknown at trace time.
        ({ELEMENTS: 1.2, ELEMENTS // 2: 0.7}, 14, False),
    ),
    ids=("formula", "products", "both_any_batch"),
)
def test_fit_with_jit_compile_trains_as_keras_does_by_either_form(
    cells, samples, drop_remainder, empty_path_cache
):
    # A CNN compiled with XLA, trained with Keras's `GroupNormalization(-1)`
    # from the same weights: the same losses and weights to float32
    # rounding, whichever form the race chose for each batch size.
    use_policy("float32")
    _write_cells(cells, "float32")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, *SHAPE[1:3], 3)).astype("float32")
    y = rng.normal(size=(samples, 1)).astype("float32")
    dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(
        SHAPE[0], drop_remainder=drop_remainder
    )
    ours = _fit_cnn(layers.InstanceNormalization(), dataset)
    theirs = _fit_cnn(keras.layers.GroupNormalization(groups=-1), dataset)
    assert np.isfinite(ours[0]).all() and ours[0][-1] < ours[0][0]
    np.testing.assert_allclose(ours[0], theirs[0], rtol=1e-4)
    for mine, keras_weight in zip(ours[1], theirs[1], strict=True):
        np.testing.assert_allclose(mine, keras_weight, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shape", [(0, 5, 6, 4), (2, 0, 3, 4)], ids=["batch", "rows"])
def test_an_empty_input_inside_xla_with_cached_cells(monkeypatch, shape):
    # GroupNormalization(groups=-1) gives an empty output; the choice between
    # products and formula must not divide by the input's zero size.
    cell = {"dtype": "float32", "elements": 2**20, "ratio": 0.5}
    monkeypatch.setattr(_xla_sums_calibration, "cached_cells", lambda: [cell])
    layer = layers.InstanceNormalization()
    layer.build((None, None, None, 4))

    outputs = tf.function(layer, jit_compile=True)(tf.zeros(shape))
    assert outputs.shape == shape

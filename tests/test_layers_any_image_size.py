"""Instance norm in a step traced for any image size (a fully convolutional model).

`keras.Input((None, None, C))` traces the step with the sample size unknown,
so the path is chosen at run time by the sample size and the input's size:
each size must run its own path in one trace, forward and backward, match
float64, and `fit` must train as Keras's layer does.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import (
    as_float64,
    assert_close,
    counting_runs,
    float_inputs,
    normalization_reference,
    normalization_step,
    penalty_gradients,
    second_order_reference,
    set_random_weights,
    use_policy,
)

from keras_amp_plus import layers
from keras_amp_plus.layers import (
    _fused_normalization,
    _path_calibration,
    _path_choice,
    _per_sample_batch_norm,
    _precision,
    _size_switch,
)

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
FORMULA = _path_choice.KERAS_FORMULA
BATCH_NORM = _path_choice.BATCH_NORM
PER_SAMPLE = _path_choice.PER_SAMPLE_BATCH_NORM
CHANNELS = 4
# Scaled-down sizes, so that small tensors reach every path: the per-sample
# path competes from 256 elements per sample and runs outright from 1024;
# the "measurements" say Keras's formula below 400 elements and from 1600,
# per sample (or, where it cannot run, the batch-norm kernel) between.
MIN_SAMPLE, LARGE_SAMPLE = 256, 1024

pytestmark = pytest.mark.usefixtures("empty_path_cache")


@pytest.fixture(autouse=True)
def _scaled_down_sizes(monkeypatch):
    monkeypatch.delenv(_path_choice.PATH_VARIABLE, raising=False)
    monkeypatch.setattr(_precision, "cpu_has_float16_arithmetic", lambda: True)
    monkeypatch.setattr(_per_sample_batch_norm, "MIN_SAMPLE_ELEMENTS", MIN_SAMPLE)
    monkeypatch.setattr(_path_choice, "LARGE_SAMPLE_ELEMENTS", LARGE_SAMPLE)

    def measured(elements, trailing, dtype, unknown_batch, unavailable=()):
        if elements < 400 or elements >= 1600:
            return FORMULA
        return BATCH_NORM if PER_SAMPLE in unavailable else PER_SAMPLE

    monkeypatch.setattr(_path_calibration, "measured_path", measured)


def _record_paths(monkeypatch):
    """Return the list every path's forward and backward append to as they run."""
    ran = []
    fused = _fused_normalization
    tables = {"forward": fused._FORWARD_BY_PATH, "backward": fused._BACKWARD_BY_PATH}
    for direction, table in tables.items():
        for path in (FORMULA, BATCH_NORM, PER_SAMPLE):
            counted = counting_runs(table[path], ran, (direction, path))
            monkeypatch.setitem(table, path, counted)
    return ran


def _any_size_step(layer, batch, compute):
    return normalization_step(
        layer, tf.TensorSpec((batch, None, None, CHANNELS), compute)
    )


# (batch, height, width): elements per sample = height * width * 4.
_SIZES_OF_ANY_BATCH = (
    ((2, 4, 4), FORMULA),  # 64 a sample, 128 in all: measured formula
    ((2, 7, 8), BATCH_NORM),  # 224 a sample: per sample cannot compete
    ((2, 8, 8), PER_SAMPLE),  # 256 a sample, 512 in all: measured per sample
    ((16, 5, 6), FORMULA),  # 1920 in all: measured formula
    ((2, 16, 16), PER_SAMPLE),  # 1024 a sample: per sample whatever was measured
    ((3, 4, 4), FORMULA),
)


@pytest.mark.parametrize("batch", (2, None), ids=("known batch", "any batch"))
@pytest.mark.parametrize("policy_name", POLICIES)
def test_each_image_size_runs_its_path_in_one_trace(policy_name, batch, monkeypatch):
    ran = _record_paths(monkeypatch)
    compute = use_policy(policy_name).compute_dtype
    layer = layers.InstanceNormalization()
    layer.build((batch, None, None, CHANNELS))
    set_random_weights(layer)
    gamma = np.reshape(as_float64(layer.gamma), (1, 1, 1, CHANNELS))
    beta = np.reshape(as_float64(layer.beta), (1, 1, 1, CHANNELS))
    step = _any_size_step(layer, batch, compute)
    for sizes, path in _SIZES_OF_ANY_BATCH:
        if batch is not None and sizes[0] != batch:
            continue
        ran.clear()
        shape = (*sizes, CHANNELS)
        x, upstream, x64, upstream64 = float_inputs(shape, 0.0, compute)
        outputs, grads = step(x, upstream)
        ref = normalization_reference(x64, upstream64, gamma, beta, 1e-3, (1, 2))
        assert_close(outputs, ref[0], compute, f"outputs at {shape}")
        for name, grad, expected in zip(
            ("x", "gamma", "beta"), grads, ref[1:], strict=True
        ):
            expected = np.reshape(expected, grad.shape)
            assert_close(grad, expected, compute, f"{name} gradient at {shape}")
        assert sorted(ran) == [("backward", path), ("forward", path)], shape
    assert step.experimental_get_tracing_count() == 1


def test_a_second_order_gradient_through_the_switch_matches_float64():
    # As for any batch size (`test_layers_paths`): a gradient penalty through
    # the switch by image size, tapes inside the step as a `train_step`
    # takes them.
    use_policy("float32")
    layer = layers.InstanceNormalization()
    layer.build((None, None, None, CHANNELS))
    spec = tf.TensorSpec((None, None, None, CHANNELS), tf.float32)
    step = tf.function(
        lambda *args: penalty_gradients(layer, *args), input_signature=[spec] * 3
    )
    ones, zeros = np.ones((1, 1, 1, CHANNELS)), np.zeros((1, 1, 1, CHANNELS))
    for shape in ((2, 4, 4, CHANNELS), (1, 6, 5, CHANNELS)):
        x, upstream, x64, upstream64 = float_inputs(shape, 0.0, "float32")
        direction = tf.random.stateless_normal(shape, (1, 2))
        _, second = step(x, upstream, direction)
        expected = second_order_reference(
            x64, upstream64, as_float64(direction), ones, zeros, (1, 2)
        )
        atol = 1e-3 * np.abs(expected).max()
        np.testing.assert_allclose(as_float64(second), expected, rtol=1e-3, atol=atol)


def _fully_convolutional(normalization):
    keras.utils.set_random_seed(5)
    images = keras.Input((None, None, 3))
    x = keras.layers.Conv2D(CHANNELS, 3, padding="same")(images)
    x = keras.layers.Conv2D(1, 1)(normalization(x))
    return keras.Model(images, x)


def _noting(switch, name, switches):
    """`switch`, noting its name and the input's traced shape in `switches`."""

    def noted(*args):
        switches.append((name, tuple(args[0].shape.as_list())))
        return switch(*args)

    return noted


def _images_of_any_size(image, target):
    """As decoded images come: their height and width unknown when traced."""
    return tf.compat.v1.placeholder_with_default(image, [None, None, 3]), target


def test_fit_of_a_fully_convolutional_model_trains_like_keras(monkeypatch):
    # Images of two sizes, each a dataset of its own with a partial last
    # batch: one step traced for any image size, three paths taken.
    ran = _record_paths(monkeypatch)
    switches = []
    for name in ("switch_on_sample_size", "switch_on_batch_size"):
        monkeypatch.setattr(
            _size_switch, name, _noting(getattr(_size_switch, name), name, switches)
        )
    use_policy("float32")
    models = [
        _fully_convolutional(layers.InstanceNormalization(epsilon=1e-3)),
        _fully_convolutional(keras.layers.GroupNormalization(groups=-1, epsilon=1e-3)),
    ]
    initial = models[0].get_weights()
    rng = np.random.default_rng(0)
    datasets = []
    for size in (6, 16):  # 144 and 1024 elements per sample
        x = rng.normal(2.0, 1.5, (5, size, size, 3)).astype("float32")
        y = rng.normal(0.0, 1.0, (5, size, size, 1)).astype("float32")
        images = tf.data.Dataset.from_tensor_slices((x, y))
        datasets.append(images.map(_images_of_any_size).batch(3))
    for model in models:
        model.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
        for data in datasets:
            model.fit(data, epochs=2, shuffle=False, verbose=0)
    # 6x6 images: batches of 3 (432 elements, per sample cannot run: the
    # batch-norm kernel) and 2 (288: the formula); 16x16: per sample.
    # `fit` traced its step for any batch and image size only (never for
    # the size of a dataset's images), and that ran every path.
    any_size = ("switch_on_sample_size", (None, None, None, CHANNELS))
    assert switches and set(switches) == {any_size}
    forward = [path for direction, path in ran if direction == "forward"]
    assert forward.count(BATCH_NORM) == 2 and forward.count(FORMULA) == 2
    assert forward.count(PER_SAMPLE) == 4
    ours, theirs = (model.get_weights() for model in models)
    assert not np.allclose(ours[0], initial[0])
    for ours_weight, keras_weight in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(ours_weight, keras_weight, rtol=2e-4, atol=2e-5)


def test_paths_by_sample_size_follow_the_sample_then_the_size():
    # Evaluated while a step is traced: eager execution takes the kernels.
    found = _traced(lambda: _path_choice.paths_by_sample_size("bfloat16", True))
    (first, small), (middle, mid), (large, largest) = found
    assert (first, middle, large) == (1, MIN_SAMPLE, LARGE_SAMPLE)
    assert small[0] == (1, FORMULA) and (small[1][1], small[2][1]) == (
        BATCH_NORM,
        FORMULA,
    )
    assert [path for _, path in mid] == [FORMULA, PER_SAMPLE, FORMULA]
    assert largest == ((1, PER_SAMPLE),)
    # float64 (or a tiny epsilon): no batch-norm kernel, the kernels.
    only = _traced(lambda: _path_choice.paths_by_sample_size("float64", False))
    assert only == ((1, ((1, _path_choice.FUSED_KERNELS),)),)


def _traced(choose):
    """Return `choose()` as evaluated while a tf.function is traced."""
    found = []
    tf.function(lambda: found.append(choose()) or tf.constant(0))()
    return found[0]


@pytest.mark.parametrize("height", (4, 16), ids=("formula", "per sample"))
def test_an_empty_batch_of_any_image_size_normalizes_to_an_empty_batch(height):
    # A replica's share of a partial batch under tf.distribute can be empty;
    # large samples take the per-sample loop whatever the batch size.
    use_policy("float32")
    layer = layers.InstanceNormalization()
    layer.build((None, None, None, CHANNELS))
    step = _any_size_step(layer, None, tf.float32)
    empty = tf.zeros((0, height, height, CHANNELS))
    outputs, (x_grad, gamma_grad, beta_grad) = step(empty, empty)
    assert outputs.shape == x_grad.shape == empty.shape
    np.testing.assert_array_equal(gamma_grad, np.zeros(CHANNELS))
    np.testing.assert_array_equal(beta_grad, np.zeros(CHANNELS))

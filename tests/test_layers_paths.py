"""The normalization layers pick their implementation per shape and context.

Both implementations (fused XLA kernels, Keras's formula) must match float64
references with float32 statistics, in graph steps and inside XLA-compiled
steps; the choice must follow the rules in `_path_choice`.
"""

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import (
    as_float64,
    assert_close,
    check_normalization,
    counting_runs,
    float_inputs,
    normalization_reference,
    normalization_step,
    penalty_gradients,
    second_order_reference,
    set_random_weights,
    swish_reference,
    use_policy,
)

from keras_amp_plus import _compat, _hardware, layers
from keras_amp_plus.layers import (
    _batch_norm_formula,
    _fused_normalization,
    _path_calibration,
    _path_choice,
    _per_sample_batch_norm,
    _precision,
)

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
_CPU_HAS_FLOAT16_ARITHMETIC = _precision.cpu_has_float16_arithmetic

pytestmark = pytest.mark.usefixtures("empty_path_cache")


@pytest.fixture(autouse=True)
def _float16_arithmetic(monkeypatch):
    """A CPU with float16 arithmetic, where float16 follows the measurements.

    Tests of CPUs without it say so; this keeps the rest CPU-independent.
    """
    monkeypatch.setattr(_precision, "cpu_has_float16_arithmetic", lambda: True)


class _StepWrapped:
    """The layer, called inside a tf.function (graph or XLA-compiled) step."""

    def __init__(self, layer, jit_compile):
        self.inner = layer
        self.call_in_step = tf.function(lambda x: layer(x), jit_compile=jit_compile)

    def __getattr__(self, name):  # build, weights, gamma, beta, epsilon
        return getattr(self.inner, name)

    def __call__(self, x):
        return self.call_in_step(x)


# Inputs far from zero: the kernels subtract the mean first and pass on
# N(1000, 1); Keras's formula cancels `x * inv` against `mean * inv` there (as
# Keras's own layers do), so it is held to the same tolerance on N(100, 1).
# TensorFlow's batch-norm kernel (instance norm's third path) passes N(1000, 1)
# as well.
_FAR_MEAN = {
    _path_choice.FUSED_KERNELS: 1000.0,
    _path_choice.KERAS_FORMULA: 100.0,
    _path_choice.BATCH_NORM: 1000.0,
}


@pytest.mark.parametrize("jit_compile", (False, True))
@pytest.mark.parametrize(
    "path",
    (_path_choice.FUSED_KERNELS, _path_choice.KERAS_FORMULA, _path_choice.BATCH_NORM),
)
@pytest.mark.parametrize("policy_name", POLICIES)
def test_each_path_matches_float64_in_graph_and_xla(
    policy_name, path, jit_compile, monkeypatch
):
    monkeypatch.setenv(_path_choice.PATH_VARIABLE, path)
    policy = use_policy(policy_name)
    for mean in (0.0, _FAR_MEAN[path]):
        ln = _StepWrapped(layers.LayerNormalization(), jit_compile)
        check_normalization(ln, (16, 64), mean, policy, (1,), (1, 64))
        # Sequences, as transformers feed them, run as (rows, features).
        seq = _StepWrapped(layers.LayerNormalization(), jit_compile)
        check_normalization(seq, (2, 8, 64), mean, policy, (2,), (1, 1, 64))
        last_two = _StepWrapped(layers.LayerNormalization(axis=[-2, -1]), jit_compile)
        params = (1, 1, 4, 16)
        check_normalization(last_two, (2, 8, 4, 16), mean, policy, (2, 3), params)
        inorm = _StepWrapped(layers.InstanceNormalization(), jit_compile)
        shape, params = (4, 8, 8, 16), (1, 1, 1, 16)
        check_normalization(inorm, shape, mean, policy, (1, 2), params)


@pytest.mark.parametrize(
    "path", ("auto", _path_choice.FUSED_KERNELS, _path_choice.KERAS_FORMULA)
)
@pytest.mark.parametrize(
    "layer_class", (layers.LayerNormalization, layers.InstanceNormalization)
)
def test_an_empty_batch_on_each_path_eager_and_in_a_step(
    layer_class, path, monkeypatch
):
    # A replica's share of a partial batch can be empty; eager calls run the
    # plain formula at a shape's first call, the path from its second on.
    monkeypatch.setenv(_path_choice.PATH_VARIABLE, path)
    use_policy("mixed_bfloat16")
    shape = (0, 4, 4, 8)
    layer = layer_class()
    layer.build((None, *shape[1:]))

    def forward_backward(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            outputs = layer(x)
        return outputs, tape.gradient(outputs, [x, *layer.trainable_weights])

    step = tf.function(forward_backward)
    empty = tf.zeros(shape, tf.bfloat16)
    for run in (forward_backward, forward_backward, step):
        outputs, (x_grad, *weight_grads) = run(empty)
        assert outputs.shape == x_grad.shape == shape
        for weight_grad in weight_grads:
            np.testing.assert_array_equal(as_float64(weight_grad), 0.0)


class _UnknownShapeStep(_StepWrapped):
    """The layer in a graph step traced for inputs of unknown size."""

    def __init__(self, layer, shape):
        self.inner = layer
        unknown = [None] * (len(shape) - 1) + [shape[-1]]  # channels are known
        spec = tf.TensorSpec(unknown, layer.compute_dtype)
        self.call_in_step = tf.function(lambda x: layer(x), input_signature=[spec])


def _measure_by_size(patch, small, large, first_large):
    """Patch the measurements: `small` below `first_large` elements, else `large`."""
    patch.setattr(
        _path_calibration,
        "measured_path",
        lambda elements, trailing, dtype, unknown_batch, unavailable=(): (
            small if elements < first_large else large
        ),
    )


def _check_path_of_each_batch(make_layer, sample, stat_axes, small, large, policy_name):
    """`make_layer()` traced once for any batch size runs each batch's path.

    Forward and backward: the switch's gradient runs the backward of the
    path its forward ran, and every gradient matches float64.
    """
    fused = _fused_normalization
    tables = {"forward": fused._FORWARD_BY_PATH, "backward": fused._BACKWARD_BY_PATH}
    ran = []
    with pytest.MonkeyPatch.context() as patch:
        _measure_by_size(patch, small, large, 4 * 256)
        for direction, table in tables.items():
            for path in (small, large):
                counted = counting_runs(table[path], ran, (direction, path))
                patch.setitem(table, path, counted)
        compute = use_policy(policy_name).compute_dtype
        layer = make_layer()
        layer.build((None, *sample))
        set_random_weights(layer)
        params = (1,) * len(sample) + (sample[-1],)
        gamma = np.reshape(as_float64(layer.gamma), params)
        beta = np.reshape(as_float64(layer.beta), params)
        step = normalization_step(layer, tf.TensorSpec((None, *sample), compute))

        # 256 elements per sample: batches of 2 and 3 are small, 6 large.
        for batch, path in ((2, small), (6, large), (3, small)):
            ran.clear()
            x, upstream, x64, upstream64 = float_inputs((batch, *sample), 0.0, compute)
            outputs, grads = step(x, upstream)
            ref = normalization_reference(x64, upstream64, gamma, beta, 1e-3, stat_axes)
            assert_close(outputs, ref[0], compute, "outputs")
            for name, grad, expected in zip(
                ("x", "gamma", "beta"), grads, ref[1:], strict=True
            ):
                expected = np.reshape(expected, grad.shape)
                assert_close(grad, expected, compute, f"{name} gradient")
            assert sorted(ran) == [("backward", path), ("forward", path)]
        assert step.experimental_get_tracing_count() == 1


@pytest.mark.parametrize("policy_name", POLICIES)
@pytest.mark.parametrize(
    "small, large",
    (
        (_path_choice.KERAS_FORMULA, _path_choice.BATCH_NORM),
        (_path_choice.FUSED_KERNELS, _path_choice.KERAS_FORMULA),
        (_path_choice.BATCH_NORM, _path_choice.FUSED_KERNELS),
    ),
    ids=("formula_then_batch_norm", "kernels_then_formula", "batch_norm_then_kernels"),
)
def test_an_unknown_batch_size_runs_the_path_of_each_batch(
    small, large, policy_name, monkeypatch
):
    # `fit` often traces its step with an unknown batch size (a tf.data
    # pipeline, a partial last batch); the path chosen for each batch's size
    # must still be the one that runs, switched at run time in one trace.
    monkeypatch.delenv(_path_choice.PATH_VARIABLE, raising=False)
    _check_path_of_each_batch(
        layers.InstanceNormalization, (4, 4, 16), (1, 2), small, large, policy_name
    )


@pytest.mark.parametrize("policy_name", POLICIES)
def test_sequences_of_unknown_batch_size_run_the_path_of_each_batch(
    policy_name, monkeypatch
):
    # Layer norm of (batch, sequence, features) runs on (rows, features):
    # the switch reads the batch's rows and still picks each batch's path.
    monkeypatch.delenv(_path_choice.PATH_VARIABLE, raising=False)
    kernels, formula = _path_choice.FUSED_KERNELS, _path_choice.KERAS_FORMULA
    _check_path_of_each_batch(
        layers.LayerNormalization, (8, 32), (2,), kernels, formula, policy_name
    )


def _instance_norm_any_batch(sample, jit_compile=False):
    """A built instance norm with random weights, in a step for any batch size."""
    layer = layers.InstanceNormalization()
    layer.build((None, *sample))
    set_random_weights(layer)
    params = (1,) * len(sample) + (sample[-1],)
    gamma = np.reshape(as_float64(layer.gamma), params)
    beta = np.reshape(as_float64(layer.beta), params)
    spec = tf.TensorSpec((None, *sample), tf.float32)
    step = tf.function(
        lambda x: layer(x), input_signature=[spec], jit_compile=jit_compile
    )
    return step, gamma, beta


@pytest.mark.parametrize("jit_compile", (False, True), ids=("graph", "xla"))
@pytest.mark.parametrize(
    "path",
    (_path_choice.FUSED_KERNELS, _path_choice.KERAS_FORMULA, _path_choice.BATCH_NORM),
)
def test_one_path_differentiates_twice_like_float64(path, jit_compile, monkeypatch):
    # A gradient penalty (WGAN-GP, R1) differentiates the layer's gradient
    # again: every path's explicit gradient is differentiable itself, also
    # inside XLA (where the batch-norm kernel falls back to the kernels).
    monkeypatch.setenv(_path_choice.PATH_VARIABLE, path)
    use_policy("float32")
    step, gamma, beta = _instance_norm_any_batch((4, 4, 4), jit_compile)
    x, upstream, x64, upstream64 = float_inputs((2, 4, 4, 4), 0.0, tf.float32)
    direction = tf.random.stateless_normal(x.shape, (1, 2))
    x_grad, second = penalty_gradients(step, x, upstream, direction)
    ref = normalization_reference(x64, upstream64, gamma, beta, 1e-3, (1, 2))
    assert_close(x_grad, ref[1], "float32", "x gradient")
    expected = second_order_reference(
        x64, upstream64, as_float64(direction), gamma, beta, (1, 2)
    )
    atol = 1e-3 * np.abs(expected).max()
    np.testing.assert_allclose(as_float64(second), expected, rtol=1e-3, atol=atol)


@pytest.mark.parametrize("tapes", ["outside_the_step", "inside_the_step"])
def test_a_second_order_gradient_through_the_switch_matches_float64(tapes, monkeypatch):
    # A gradient penalty (WGAN-GP, R1) through the run-time switch: with the
    # tapes around the step, or inside it as a custom `train_step` takes
    # them (`fit` on a pipeline without `drop_remainder`). TensorFlow
    # differentiates a switch inside a gradient function to zeros; the
    # switch's own second-order gradient must not vanish.
    monkeypatch.delenv(_path_choice.PATH_VARIABLE, raising=False)
    formula, batch_norm = _path_choice.KERAS_FORMULA, _path_choice.BATCH_NORM
    _measure_by_size(monkeypatch, formula, batch_norm, 128)
    use_policy("float32")
    step, gamma, beta = _instance_norm_any_batch((4, 4, 4))
    spec = tf.TensorSpec((None, 4, 4, 4), tf.float32)
    in_step = tf.function(
        lambda *args: penalty_gradients(step, *args), input_signature=[spec] * 3
    )
    for batch in (1, 3):  # 64 elements a sample: the formula, then batch norm
        x, upstream, x64, upstream64 = float_inputs((batch, *(4, 4, 4)), 0.0, "float32")
        direction = tf.random.stateless_normal(x.shape, (1, batch))
        if tapes == "inside_the_step":
            x_grad, second = in_step(x, upstream, direction)
        else:
            x_grad, second = penalty_gradients(step, x, upstream, direction)
        ref = normalization_reference(x64, upstream64, gamma, beta, 1e-3, (1, 2))
        assert_close(x_grad, ref[1], "float32", "x gradient")
        expected = second_order_reference(
            x64, upstream64, as_float64(direction), gamma, beta, (1, 2)
        )
        atol = 1e-3 * np.abs(expected).max()
        np.testing.assert_allclose(as_float64(second), expected, rtol=1e-3, atol=atol)


def _conv_classifier(normalization):
    """A small CNN around `normalization` (an instance-norm layer)."""
    keras.utils.set_random_seed(3)
    images = keras.Input((6, 6, 3))
    x = keras.layers.Conv2D(8, 3, padding="same")(images)
    x = keras.layers.GlobalAveragePooling2D()(normalization(x))
    return keras.Model(images, keras.layers.Dense(2)(x))


@pytest.mark.parametrize(
    "large_path", (_path_choice.BATCH_NORM, _path_choice.PER_SAMPLE_BATCH_NORM)
)
def test_fit_on_a_dataset_trains_through_the_switch_like_keras(large_path, monkeypatch):
    # `fit` on a tf.data pipeline with a partial last batch traces one step
    # for any batch size: full batches take one path, the last another, and
    # the weights after an epoch are those Keras's layer trains to.
    monkeypatch.delenv(_path_choice.PATH_VARIABLE, raising=False)
    # These samples are small: let the per-sample loop take them.
    monkeypatch.setattr(_per_sample_batch_norm, "MIN_SAMPLE_ELEMENTS", 1)
    formula = _path_choice.KERAS_FORMULA
    _measure_by_size(monkeypatch, formula, large_path, 3 * 36 * 8)
    ran = []
    fused = _fused_normalization
    for table in (fused._FORWARD_BY_PATH, fused._BACKWARD_BY_PATH):
        for path in (formula, large_path):
            monkeypatch.setitem(table, path, counting_runs(table[path], ran, path))
    use_policy("float32")
    rng = np.random.default_rng(0)
    x = rng.normal(2.0, 1.5, (10, 6, 6, 3)).astype("float32")
    y = rng.integers(0, 2, 10)
    data = tf.data.Dataset.from_tensor_slices((x, y)).batch(4)  # 4, 4, 2
    models = [
        _conv_classifier(layers.InstanceNormalization(epsilon=1e-3)),
        _conv_classifier(keras.layers.GroupNormalization(groups=-1, epsilon=1e-3)),
    ]
    initial = models[0].get_weights()
    for model in models:
        model.compile(
            optimizer=keras.optimizers.SGD(0.5),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        model.fit(data, epochs=2, shuffle=False, verbose=0)
    # Forward and backward: two full batches an epoch, then the partial one.
    assert ran.count(large_path) == 2 * 4
    assert ran.count(_path_choice.KERAS_FORMULA) == 2 * 2
    ours, theirs = (model.get_weights() for model in models)
    assert not np.allclose(ours[0], initial[0])
    for ours_weight, keras_weight in zip(ours, theirs, strict=True):
        np.testing.assert_allclose(ours_weight, keras_weight, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("policy_name", POLICIES)
@pytest.mark.parametrize(
    "shape", ((3, 40, 6), (2, 5, 6, 8), (2, 3, 4, 5, 6)), ids=("1d", "2d", "3d")
)
def test_instance_norm_kernels_match_float64(shape, policy_name, monkeypatch):
    # The kernels normalize instance norm channels last in place, its sums
    # batched products: any rank, and sizes known only at run time.
    monkeypatch.setenv(_path_choice.PATH_VARIABLE, _path_choice.FUSED_KERNELS)
    policy = use_policy(policy_name)
    rank = len(shape)
    stat_axes = tuple(range(1, rank - 1))
    params = (1,) * (rank - 1) + (shape[-1],)
    for mean in (0.0, _FAR_MEAN[_path_choice.FUSED_KERNELS]):
        for layer in (
            _StepWrapped(layers.InstanceNormalization(), jit_compile=False),
            _StepWrapped(layers.InstanceNormalization(), jit_compile=True),
            _UnknownShapeStep(layers.InstanceNormalization(), shape),
        ):
            check_normalization(layer, shape, mean, policy, stat_axes, params)


def test_instance_norm_kernels_sum_full_size_tensors_as_two_products_a_pass():
    # Each kernel sums two full-size tensors over the middle axes, one batched
    # product each (XLA's fused reductions are scalar loops): the forward the
    # input and its squared deviation, the backward the upstream gradient and
    # its product with the normalized input. The weights' gradients are sums
    # of those per-sample sums over the samples (axis 0): written as means
    # times the count, XLA summed the full-size tensors again over every axis.
    shape = (4, 8, 8, 16)
    x, upstream = tf.ones(shape), tf.ones(shape)
    statistics = (tf.ones([4, 1, 1, 16]),) * 3
    gamma = tf.ones([1, 1, 1, 16])
    forward = _fused_normalization._normalize_forward.experimental_get_compiler_ir(
        x, gamma, gamma, 1e-3, (1, 2), tf.float32
    )("optimized_hlo")
    backward = _fused_normalization._normalize_backward.experimental_get_compiler_ir(
        upstream, x, statistics, gamma, (1, 2), (0, 1, 2)
    )("optimized_hlo")
    for hlo in (forward, backward):
        lines = hlo.splitlines()
        dots = [line for line in lines if " dot(" in line]
        assert len(dots) == 2
        assert all("f32[4,1,16]" in line or "f32[4,16]" in line for line in dots)
    reduced_axes = [
        line.split("dimensions={")[1].split("}")[0]
        for line in backward.splitlines()
        if " reduce(" in line
    ]
    assert reduced_axes and all(axes == "0" for axes in reduced_axes)


def _path_taken(
    jit_compile,
    elements_threshold,
    monkeypatch,
    trailing=True,
    dtype="float32",
    batch_norm_applies=False,
):
    """Return the path `normalization_path` picks for a (8, 16) input."""
    monkeypatch.setattr(_path_choice, "DOT_SUM_MIN_ELEMENTS", elements_threshold)
    taken = []

    @tf.function(jit_compile=jit_compile)
    def step(x):
        elements = x.shape.num_elements()
        taken.append(
            _path_choice.normalization_path(
                elements, trailing, dtype, batch_norm_applies
            )
        )
        return x

    step(tf.zeros([8, 16]))
    return taken[0]


def test_paths_by_batch_size_are_one_path_where_the_size_is_known(monkeypatch):
    monkeypatch.delenv(_path_choice.PATH_VARIABLE, raising=False)
    monkeypatch.setattr(
        _path_calibration,
        "measured_path",
        lambda elements, trailing, dtype, unknown_batch, unavailable=(): (
            ("a" if elements < 100 else "b") + ("?" if unknown_batch else "")
        ),
    )
    runs = {}

    @tf.function
    def step():
        runs["unknown"] = _path_choice.paths_by_batch_size((None, 10), False)
        runs["known"] = _path_choice.paths_by_batch_size((20, 10), False)
        runs["lengths"] = _path_choice.paths_by_batch_size((None, None, 10), False)
        return 0

    step()
    # An unknown batch size: the winners measured in steps traced that way.
    assert runs["unknown"] == ((1, "a?"), (10, "b?"))
    assert runs["known"] == ((1, "b"),)
    # Variable lengths (not only the batch): the kernels, in row buckets.
    assert runs["lengths"] == ((1, _path_choice.FUSED_KERNELS),)


def test_inside_xla_layer_norm_takes_the_kernels_at_every_size(monkeypatch):
    # Their sums are matrix products: they beat XLA's fusion of the formula
    # at every size, with XLA's code capped at AVX2 too.
    monkeypatch.delenv(_path_choice.PATH_VARIABLE, raising=False)
    kernels = _path_choice.FUSED_KERNELS
    assert _path_taken(True, 1000, monkeypatch) == kernels  # below the dot size
    assert _path_taken(True, 128, monkeypatch) == kernels


def test_inside_xla_instance_norm_always_keras_formula(monkeypatch):
    # Statistics over middle axes: the kernels never beat XLA's fusion of the
    # formula inside a compiled model, whatever the size.
    monkeypatch.delenv(_path_choice.PATH_VARIABLE, raising=False)
    for threshold in (1000, 128):
        taken = _path_taken(True, threshold, monkeypatch, trailing=False)
        assert taken == _path_choice.KERAS_FORMULA


def _write_measurements(cells):
    path = _path_calibration.cache_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as file:
        json.dump({"cells": cells}, file)


def _cell(trailing, dtype, elements, path):
    return {"trailing": trailing, "dtype": dtype, "elements": elements, "path": path}


def test_steps_of_unknown_batch_size_follow_their_own_measurements():
    # TensorFlow's kernels lose optimizations a known batch size allows (the
    # formula's and the batch-norm kernel's), XLA's do not: the winners differ.
    kernels, formula = _path_choice.FUSED_KERNELS, _path_choice.KERAS_FORMULA
    _write_measurements(
        [
            _cell(False, "float32", 128, formula),
            {**_cell(False, "float32", 128, kernels), "unknown_batch": True},
        ]
    )
    assert _path_calibration.measured_path(128, False, "float32") == formula
    assert _path_calibration.measured_path(128, False, "float32", True) == kernels


def test_unmeasured_steps_of_unknown_batch_size_take_the_safe_side(monkeypatch):
    # No measurement: the kernels, but for instance norms too small to pay
    # for their XLA launches and transposes, and for ones so large that
    # TensorFlow's batch-norm kernel is the safe side (where it applies).
    # (With oneDNN: without, float32 instance norms run the formula.)
    monkeypatch.setattr(_compat, "onednn_enabled", lambda: True)
    kernels, formula = _path_choice.FUSED_KERNELS, _path_choice.KERAS_FORMULA
    bn = _path_choice.BATCH_NORM
    for elements, trailing, batch_norm_applies, expected in (
        (2**16, False, True, formula),
        (2**18, False, True, kernels),
        (2**16, True, False, kernels),
        (2**24, True, False, kernels),
        (2**24, False, True, bn),
        (2**24, False, False, kernels),
    ):
        for dtype in ("bfloat16", "float16", "float32"):
            path = _path_choice._graph_step_path(
                elements, trailing, dtype, batch_norm_applies, True
            )
            assert path == expected, (elements, trailing, batch_norm_applies, dtype)
    # Where the batch size is known, Keras's formula is the side to beat.
    assert _path_calibration.safe_path(False, False, 2**24, True) == formula


def _timed_cell(dtype, elements, ratios):
    path = _path_calibration.winner(
        ratios, _path_calibration.safe_path(True, False, elements, True)
    )
    cell = {**_cell(False, dtype, elements, path), "unknown_batch": True}
    return {**cell, "ratios": ratios}


def test_sizes_far_from_the_measured_keep_off_a_safe_side_that_lost_there(
    monkeypatch,
):
    # With oneDNN: without it, float32 instance norms run the formula anyway.
    monkeypatch.setattr(_compat, "onednn_enabled", lambda: True)
    # Measured at 4M elements: the batch-norm kernel (the safe side of large
    # instance norms) slower than the formula in float32, faster in bfloat16.
    bn, formula = _path_choice.BATCH_NORM, _path_choice.KERAS_FORMULA
    _write_measurements(
        [
            _timed_cell("float32", 2**22, {formula: 1.0, bn: 1.2}),
            _timed_cell("bfloat16", 2**22, {formula: 1.0, bn: 0.7}),
        ]
    )
    for elements in (2**22, 2**26):  # measured, and 4 octaves beyond it
        for dtype, expected in (("float32", formula), ("bfloat16", bn)):
            path = _path_choice._graph_step_path(elements, False, dtype, True, True)
            assert path == expected, (elements, dtype)
    # One path for every batch size: no run-time switch to the loser.
    shape = (None, 64, 64, 1024)  # 2**22 elements a sample
    with tf.Graph().as_default():  # eager steps always run the kernels
        paths = _path_choice.paths_by_batch_size(shape, False, "float32", True)
    assert paths == ((1, formula),)


def test_graph_step_follows_the_measured_winner(monkeypatch):
    monkeypatch.delenv(_path_choice.PATH_VARIABLE, raising=False)
    kernels, formula = _path_choice.FUSED_KERNELS, _path_choice.KERAS_FORMULA
    # The rule (trailing axes) would pick the kernels; measured:
    # the formula for bfloat16 around 128 elements, the kernels for float32.
    _write_measurements(
        [
            _cell(True, "bfloat16", 128, formula),
            _cell(True, "float32", 128, kernels),
            _cell(False, "bfloat16", 128, kernels),
        ]
    )
    assert _path_taken(False, 1000, monkeypatch, True, "bfloat16") == formula
    assert _path_taken(False, 1000, monkeypatch, True, "float16") == formula
    assert _path_taken(False, 1000, monkeypatch, True, "float32") == kernels
    # Instance norm: the rule says the formula, the measurement the kernels.
    assert _path_taken(False, 1000, monkeypatch, False, "bfloat16") == kernels
    # Nothing measured for float32 instance norm: the rule.
    assert _path_taken(False, 1000, monkeypatch, False, "float32") == formula
    # Inside XLA the measurement (of graph steps) does not apply: the rule.
    assert _path_taken(True, 1000, monkeypatch, True, "bfloat16") == kernels


def test_large_instance_norm_follows_the_measured_winner(monkeypatch):
    # From the dot size on, layer norm always takes the kernels, while for
    # instance norm the measurement decides (TensorFlow's batch-norm kernel
    # beat the kernels there for bfloat16 and float32 on an Intel Xeon).
    monkeypatch.delenv(_path_choice.PATH_VARIABLE, raising=False)
    monkeypatch.setattr(_compat, "onednn_enabled", lambda: True)  # that Xeon's
    kernels, bn = _path_choice.FUSED_KERNELS, _path_choice.BATCH_NORM
    _write_measurements(
        [
            _cell(False, "bfloat16", 128, bn),
            _cell(True, "bfloat16", 128, _path_choice.KERAS_FORMULA),
        ]
    )
    large = 64  # the (8, 16) input is at the dot size or above
    assert _path_taken(False, large, monkeypatch, False, "bfloat16", True) == bn
    assert _path_taken(False, large, monkeypatch, False, "float16", True) == bn
    assert _path_taken(False, large, monkeypatch, True, "bfloat16") == kernels
    # Where the batch-norm kernel cannot run, or nothing was measured: the
    # kernels.
    assert _path_taken(False, large, monkeypatch, False, "bfloat16") == kernels
    assert _path_taken(False, large, monkeypatch, False, "float32", True) == kernels


@pytest.mark.parametrize("unknown_batch", (False, True))
def test_float16_instance_norm_follows_float32_without_float16_arithmetic(
    unknown_batch, monkeypatch
):
    # There every path computes float16 in float32, the input widened once,
    # so float32's races and rules decide, not bfloat16's.
    monkeypatch.setattr(_precision, "cpu_has_float16_arithmetic", lambda: False)
    kernels, bn = _path_choice.FUSED_KERNELS, _path_choice.BATCH_NORM
    formula = _path_choice.KERAS_FORMULA
    measured = {2**16: formula, 2**18: kernels, 2**20: bn}
    cells = []
    for elements, float32_path in measured.items():
        cells.append(_cell(False, "float32", elements, float32_path))
        bfloat16_path = kernels if elements < 2**18 else formula
        cells.append(_cell(False, "bfloat16", elements, bfloat16_path))
    _write_measurements([{**c, "unknown_batch": unknown_batch} for c in cells])
    for elements, expected in measured.items():
        path = _path_choice._graph_step_path(
            elements, False, "float16", True, unknown_batch
        )
        assert path == expected, elements
        float32 = _path_choice._graph_step_path(
            elements, False, "float32", True, unknown_batch
        )
        assert float32 == expected, elements
    # bfloat16 keeps its own measurements; float16 layer norm keeps the kernels.
    step_path = _path_choice._graph_step_path
    assert step_path(2**20, False, "bfloat16", True, unknown_batch) == formula
    assert step_path(2**20, True, "float16", False, unknown_batch) == kernels


def test_float16_instance_norm_takes_float32_rules_without_measurements(monkeypatch):
    # No measurement: float32's rules (the batch-norm kernel from its float32
    # size, not the half-width one; Keras's formula with oneDNN off).
    monkeypatch.setattr(_precision, "cpu_has_float16_arithmetic", lambda: False)
    _write_measurements([])
    half = _path_choice.BATCH_NORM_MIN_ELEMENTS["half"]
    wide = _path_choice.BATCH_NORM_MIN_ELEMENTS["float32"]
    for onednn, elements in ((True, half), (True, wide), (False, wide)):
        monkeypatch.setattr(_compat, "onednn_enabled", lambda onednn=onednn: onednn)
        path = _path_choice._graph_step_path(elements, False, "float16", True)
        assert path == _path_choice._graph_step_path(elements, False, "float32", True)
    monkeypatch.setattr(_compat, "onednn_enabled", lambda: True)
    formula, bn = _path_choice.KERAS_FORMULA, _path_choice.BATCH_NORM
    assert _path_choice._graph_step_path(half, False, "float16", True) == formula
    assert _path_choice._graph_step_path(half, False, "bfloat16", True) == bn


@pytest.mark.parametrize("unknown_batch", (False, True))
def test_float16_instance_norm_follows_the_measurements_with_float16_arithmetic(
    unknown_batch,
):
    # bfloat16's winner, except where the kernels beat the batch-norm kernel
    # narrowly: XLA's float16 code slows the kernels down more than it does
    # TensorFlow's batch-norm kernel.
    kernels, bn = _path_choice.FUSED_KERNELS, _path_choice.BATCH_NORM
    ratios = {_FORMULA: 1.0, _KERNELS: 0.48, _BATCH_NORM: 0.51}
    clear = {**ratios, _KERNELS: 0.8 * 0.51}
    cells = [
        _cell(False, "bfloat16", 2**20, kernels),  # hand-written: no ratios
        {**_cell(False, "bfloat16", 2**22, kernels), "ratios": ratios},
        {**_cell(False, "bfloat16", 2**26, kernels), "ratios": clear},
    ]
    _write_measurements([{**c, "unknown_batch": unknown_batch} for c in cells])
    for elements, expected in ((2**20, kernels), (2**22, bn), (2**26, kernels)):
        for applies in (True, False):
            path = _path_choice._graph_step_path(
                elements, False, "float16", applies, unknown_batch
            )
            if expected == bn and not applies:
                # No batch-norm kernel: the rule (the kernels from the dot size).
                expected = kernels
            assert path == expected, (elements, applies)
        bfloat16 = _path_choice._graph_step_path(
            elements, False, "bfloat16", True, unknown_batch
        )
        assert bfloat16 == kernels


def test_cpu_float16_arithmetic_follows_the_cpu_flags(monkeypatch):
    read = _CPU_HAS_FLOAT16_ARITHMETIC  # not the autouse pin
    for flags, expected in (
        ("avx512f avx512_bf16", False),
        ("avx512f avx512_bf16 avx512_fp16", True),
        ("amx_bf16 amx_fp16", True),
    ):
        text = f"model name\t: Test CPU\nflags\t\t: fpu {flags}\n"
        monkeypatch.setattr(_hardware, "read_cpuinfo", lambda *a, text=text: text)
        read.cache_clear()
        assert read() is expected, flags
    monkeypatch.setattr(_hardware, "read_cpuinfo", lambda *a: None)
    read.cache_clear()
    assert read() is None  # unknown: the measurements decide
    monkeypatch.undo()
    read.cache_clear()  # this machine's answer again for later tests


def test_measurements_far_from_the_size_do_not_apply(monkeypatch):
    monkeypatch.delenv(_path_choice.PATH_VARIABLE, raising=False)
    _write_measurements([_cell(True, "float32", 2**20, _path_choice.KERAS_FORMULA)])
    # 128 elements is 13 octaves away: the rule (kernels) decides.
    assert _path_taken(False, 1000, monkeypatch) == _path_choice.FUSED_KERNELS


def test_measure_paths_caches_winners_per_machine(monkeypatch):
    monkeypatch.setattr(_path_calibration, "TRAILING_SHAPES", ((16, 8),))
    middle_shapes = ((2, 2, 2, 8), (2, 4, 4, 8), (4, 4, 4, 8))
    monkeypatch.setattr(_path_calibration, "MIDDLE_SHAPES", middle_shapes)
    monkeypatch.setattr(_path_calibration, "DTYPES", ("bfloat16",))
    # Instance norms of 64 elements are small, of 512 large, here.
    monkeypatch.setattr(_path_calibration, "KERNELS_SAFE_MIN_ELEMENTS", 128)
    monkeypatch.setattr(_path_calibration, "BATCH_NORM_SAFE_MIN_ELEMENTS", 512)
    result = _path_calibration.measure_paths(seconds=60.0, reps=1)
    # Each shape in a step traced for its batch size and for any batch size.
    shapes = [[16, 8], *map(list, middle_shapes)]
    assert [(cell["shape"], cell["unknown_batch"]) for cell in result["cells"]] == [
        (shape, unknown) for shape in shapes for unknown in (False, True)
    ]
    with open(_path_calibration.cache_path(), encoding="utf-8") as file:
        cached = json.load(file)["cells"]
    assert cached == result["cells"]
    assert set(cached[1]["ratios"]) == {"fused_kernels", "keras_formula"}
    assert set(cached[3]["ratios"]) == {"fused_kernels", "keras_formula", "batch_norm"}
    # The formula is the safe side at a known batch size; at any, the kernels
    # but for small instance norms (the formula) and large ones (the
    # batch-norm kernel). Another path must beat it by the margin.
    kernels, formula = _path_choice.FUSED_KERNELS, _path_choice.KERAS_FORMULA
    safe_at_any_batch = (kernels, formula, kernels, _path_choice.BATCH_NORM)
    for index, cell in enumerate(cached):
        ratios = cell["ratios"]
        safe = safe_at_any_batch[index // 2] if cell["unknown_batch"] else formula
        if ratios[safe] > ratios[formula]:  # never slower than Keras's layer
            safe = formula
        fastest = min(ratios, key=ratios.get)
        margin = _path_calibration.WIN_MARGIN * ratios[safe]
        expected = fastest if ratios[fastest] < margin else safe
        assert cell["path"] == expected
        found = _path_calibration.measured_path(
            cell["elements"], cell["trailing"], "bfloat16", cell["unknown_batch"]
        )
        assert found == cell["path"]


_FORMULA, _KERNELS, _BATCH_NORM = "keras_formula", "fused_kernels", "batch_norm"


def test_a_cell_raced_twice_takes_the_geometric_mean_of_its_passes(monkeypatch):
    # The Ice Lake doctor's pass at 16x16x16x64 (float32) timed the batch-norm
    # kernel at 0.77x the formula; a second pass, 0.96x. Alone the first
    # would choose it (it ran 1.1x the formula in the benchmarks there); both
    # choose the kernels, fast in both.
    monkeypatch.setattr(_path_calibration, "TRAILING_SHAPES", ())
    monkeypatch.setattr(_path_calibration, "MIDDLE_SHAPES", ((16, 16, 16, 64),))
    monkeypatch.setattr(_path_calibration, "DTYPES", ("float32",))
    passes = iter(
        [
            {_FORMULA: 1.0, _KERNELS: 0.80, _BATCH_NORM: 0.77},  # its batch
            {_FORMULA: 1.0, _KERNELS: 0.79, _BATCH_NORM: 1.11},  # any batch
            {_FORMULA: 1.0, _KERNELS: 0.77, _BATCH_NORM: 0.96},
            {_FORMULA: 1.0, _KERNELS: 0.85, _BATCH_NORM: 0.94},
        ]
    )
    monkeypatch.setattr(_path_calibration, "_race_cell", lambda *args: next(passes))
    cells = _path_calibration.measure_paths(seconds=60.0)["cells"]
    its_batch = cells[0]
    assert its_batch["passes"] == 2
    assert its_batch["ratios"][_BATCH_NORM] == pytest.approx((0.77 * 0.96) ** 0.5)
    assert its_batch["path"] == _KERNELS
    # Out of time after one pass: that pass alone decides.
    passes = iter([{_FORMULA: 1.0, _KERNELS: 0.80, _BATCH_NORM: 0.77}] * 2)
    cells = _path_calibration.measure_paths(seconds=60.0, passes=1)["cells"]
    assert cells[0]["passes"] == 1
    assert cells[0]["path"] == _BATCH_NORM


@pytest.mark.parametrize(
    ("ratios", "safe", "expected"),
    (
        # The safe side stands unless another path beats it by the margin.
        ({_FORMULA: 1.0, _KERNELS: 0.9}, _KERNELS, _KERNELS),
        ({_FORMULA: 1.0, _KERNELS: 0.9}, _FORMULA, _FORMULA),
        ({_FORMULA: 1.0, _KERNELS: 0.8}, _FORMULA, _KERNELS),
        # A safe side slower than Keras's formula gives way to the formula
        # (as the batch-norm kernel did without oneDNN, in float32).
        ({_FORMULA: 1.0, _KERNELS: 1.87, _BATCH_NORM: 1.16}, _BATCH_NORM, _FORMULA),
        ({_FORMULA: 1.0, _KERNELS: 0.8, _BATCH_NORM: 1.1}, _BATCH_NORM, _KERNELS),
        ({_FORMULA: 1.0, _KERNELS: 0.9, _BATCH_NORM: 1.1}, _BATCH_NORM, _FORMULA),
    ),
)
def test_a_measurement_never_chooses_a_path_slower_than_the_formula(
    ratios, safe, expected
):
    assert _path_calibration.winner(ratios, safe) == expected
    assert ratios[expected] <= ratios[_FORMULA]


def test_measurements_of_earlier_implementations_are_not_reused(monkeypatch):
    # Winners cached before a raced implementation changed would keep
    # choosing by the old code: the revision is part of the cache's name.
    _write_measurements([_cell(True, "float32", 128, _path_choice.KERAS_FORMULA)])
    assert _path_calibration.measured_path(128, True, "float32") is not None
    _path_calibration._machine_digest.cache_clear()
    revision = _path_calibration.PATHS_REVISION + 1
    monkeypatch.setattr(_path_calibration, "PATHS_REVISION", revision)
    try:
        assert _path_calibration.measured_path(128, True, "float32") is None
    finally:
        _path_calibration._machine_digest.cache_clear()


def test_measure_paths_refuses_to_run_inside_a_trace():
    @tf.function
    def step():
        _path_calibration.measure_paths(seconds=1.0)
        return tf.constant(0)

    with pytest.raises(RuntimeError, match="must run eagerly"):
        step()


def test_swish_inside_xla_is_plain_ops_for_xla_to_fuse():
    # No call into the layer's own compiled kernels inside a compiled model.
    layer = layers.Swish()
    step = tf.function(lambda x: layer(x), jit_compile=True)
    graph = step.get_concrete_function(tf.zeros([4, 8], "bfloat16")).graph
    op_types = {op.type for op in graph.get_operations()}
    assert not op_types & {"PartitionedCall", "StatefulPartitionedCall"}
    assert "Sigmoid" in op_types


def test_unmeasured_graph_step_path_follows_the_axes(monkeypatch):
    monkeypatch.delenv(_path_choice.PATH_VARIABLE, raising=False)
    # The rules with oneDNN (without it, float32 instance norms: the formula).
    monkeypatch.setattr(_compat, "onednn_enabled", lambda: True)
    kernels, formula = _path_choice.FUSED_KERNELS, _path_choice.KERAS_FORMULA
    for trailing, expected in ((True, kernels), (False, formula)):
        assert _path_taken(False, 1000, monkeypatch, trailing) == expected
        # Large inputs: the kernels on every CPU.
        assert _path_taken(False, 128, monkeypatch, trailing) == kernels


def test_graph_step_instance_norm_takes_batch_norm_from_its_size(monkeypatch):
    monkeypatch.delenv(_path_choice.PATH_VARIABLE, raising=False)
    monkeypatch.setattr(_compat, "onednn_enabled", lambda: True)  # the rule with it
    monkeypatch.setattr(
        _path_choice, "BATCH_NORM_MIN_ELEMENTS", {"half": 64, "float32": 256}
    )
    bn, formula = _path_choice.BATCH_NORM, _path_choice.KERAS_FORMULA
    for dtype, applies, expected in (
        ("bfloat16", True, bn),  # 128 elements >= 64
        ("float16", True, bn),
        ("float32", True, formula),  # 128 < 256
        ("bfloat16", False, formula),  # e.g. epsilon below the kernel's minimum
    ):
        taken = _path_taken(False, 1000, monkeypatch, False, dtype, applies)
        assert taken == expected, (dtype, applies)
    # Never inside XLA (Keras's formula there) nor for layer norm.
    assert _path_taken(True, 1000, monkeypatch, False, "bfloat16", True) == formula
    kernels = _path_choice.FUSED_KERNELS
    assert _path_taken(False, 1000, monkeypatch, True, "bfloat16", False) == kernels


def test_batch_norm_path_only_where_the_kernel_applies(monkeypatch):
    monkeypatch.setenv(_path_choice.PATH_VARIABLE, _path_choice.BATCH_NORM)
    assert _path_taken(False, 1000, monkeypatch, False, "float32", True) == "batch_norm"
    taken = _path_taken(False, 1000, monkeypatch, False, "float32", False)
    assert taken == _path_choice.FUSED_KERNELS
    x = tf.zeros([2, 4, 4, 8])
    gamma = tf.ones([1, 1, 1, 8])
    assert _batch_norm_formula.applies(x, gamma, 1e-3, (1, 2))
    assert not _batch_norm_formula.applies(x, gamma, 1e-6, (1, 2))  # epsilon
    assert not _batch_norm_formula.applies(x, gamma, 1e-3, (2, 3))  # not middle
    x64, gamma64 = tf.zeros([2, 4, 4, 8], "float64"), tf.ones([1, 1, 1, 8], "float64")
    assert not _batch_norm_formula.applies(x64, gamma64, 1e-3, (1, 2))


@pytest.mark.parametrize("policy_name", POLICIES)
def test_batch_norm_path_with_unknown_batch_matches_float64(policy_name, monkeypatch):
    # Keras traces `fit` steps with an unknown batch size.
    monkeypatch.setenv(_path_choice.PATH_VARIABLE, _path_choice.BATCH_NORM)
    policy = use_policy(policy_name)
    layer = layers.InstanceNormalization()
    compute = policy.compute_dtype
    step = tf.function(
        lambda x: layer(x),
        input_signature=[tf.TensorSpec([None, 8, 8, 16], compute)],
    )
    wrapped = _StepWrapped(layer, False)
    wrapped.call_in_step = step
    check_normalization(wrapped, (4, 8, 8, 16), 1000.0, policy, (1, 2), (1, 1, 1, 16))


def test_graph_rewrite_keeps_the_kernels(monkeypatch):
    # The rewrite would paint the formula's statistics bfloat16.
    monkeypatch.delenv(_path_choice.PATH_VARIABLE, raising=False)
    monkeypatch.setattr(_path_choice, "graph_rewrite_on", lambda: True)
    for trailing in (True, False):
        taken = _path_taken(False, 1000, monkeypatch, trailing)
        assert taken == _path_choice.FUSED_KERNELS


def test_unknown_path_variable_raises(monkeypatch):
    monkeypatch.setenv(_path_choice.PATH_VARIABLE, "fastest")
    with pytest.raises(ValueError, match="Received: KERAS_AMP_PLUS"):
        layers.LayerNormalization()(np.zeros((2, 3), "float32"))


def _swish_graph_ops(layer, x):
    """Return the op types of `layer`'s forward + backward in a graph step."""

    @tf.function
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            outputs = layer(x)
        return outputs, tape.gradient(outputs, x)

    graph = step.get_concrete_function(x).graph
    ops = {op.type for op in graph.get_operations()}
    calls = {
        op.get_attr("f").name
        for op in graph.get_operations()
        if op.type in ("PartitionedCall", "StatefulPartitionedCall")
    }
    return step, ops, calls


@pytest.mark.parametrize("onednn", (True, False))
def test_bfloat16_swish_forward_is_onednn_swish_where_onednn_is_on(onednn, monkeypatch):
    # Grappler fuses `x * sigmoid(x)` into oneDNN's swish kernel where oneDNN
    # is on; elsewhere (oneDNN off, trainable or other beta) the XLA kernel.
    monkeypatch.setattr(_compat, "onednn_enabled", lambda: onednn)
    x = tf.cast(tf.random.normal([16, 64], 0.0, 4.0, seed=3), tf.bfloat16)
    plain = layers.Swish(dtype="mixed_bfloat16")
    _, ops, calls = _swish_graph_ops(plain, x)
    assert ("Sigmoid" in ops) is onednn
    assert any("_swish_forward" in name for name in calls) is not onednn
    assert any("_swish_backward" in name for name in calls)
    for other in ({"beta": 1.5}, {"trainable_beta": True}):
        _, ops, calls = _swish_graph_ops(
            layers.Swish(**other, dtype="mixed_bfloat16"), x
        )
        assert "Sigmoid" not in ops
        assert any("_swish_forward" in name for name in calls)
    float32 = layers.Swish(dtype="float32")
    _, ops, _ = _swish_graph_ops(float32, tf.cast(x, tf.float32))
    assert "Sigmoid" not in ops


@pytest.mark.parametrize(
    "options", ({"remapping": False}, {"disable_meta_optimizer": True})
)
def test_bfloat16_swish_forward_is_xla_without_grappler_remapping(options, monkeypatch):
    # Unfused, the two ops would run slower and round twice.
    monkeypatch.setattr(_compat, "onednn_enabled", lambda: True)
    previous = tf.config.optimizer.get_experimental_options()
    tf.config.optimizer.set_experimental_options(options)
    try:
        x = tf.cast(tf.random.normal([16, 64], 0.0, 4.0, seed=3), tf.bfloat16)
        _, ops, calls = _swish_graph_ops(layers.Swish(dtype="mixed_bfloat16"), x)
    finally:
        for name in options:
            if name in previous:
                tf.config.optimizer.set_experimental_options({name: previous[name]})
            else:
                _compat.reset_grappler_option(name)
    assert tf.config.optimizer.get_experimental_options() == previous
    assert "Sigmoid" not in ops
    assert any("_swish_forward" in name for name in calls)


def test_bfloat16_swish_in_a_graph_step_is_rounded_once():
    # Either forward (oneDNN's fused kernel, the XLA kernel) computes in float32
    # and rounds once: within half a bfloat16 unit of the float64 value. Two
    # roundings (a bfloat16 sigmoid, then the product) measured up to 3.
    layer = layers.Swish(dtype="mixed_bfloat16")
    x = tf.cast(tf.random.normal([256, 1024], 0.0, 4.0, seed=1), tf.bfloat16)
    step, _, _ = _swish_graph_ops(layer, x)
    outputs, x_grad = step(x)
    x64 = as_float64(x)
    expected, expected_grad, _ = swish_reference(x64, np.ones_like(x64), 1.0)
    nonzero = np.abs(expected) > 1e-30
    error = np.abs(as_float64(outputs) - expected)[nonzero] / np.abs(expected[nonzero])
    assert error.max() <= 2.0**-8
    assert_close(x_grad, expected_grad, "bfloat16", "x gradient")


@pytest.mark.parametrize("unknown_batch", (False, True))
def test_unmeasured_float32_instance_norms_without_onednn_run_the_formula(
    unknown_batch, monkeypatch
):
    # Without oneDNN, Keras's formula won every float32 instance-norm race
    # against TensorFlow's batch-norm kernel and the kernels.
    formula, kernels = _path_choice.KERAS_FORMULA, _path_choice.FUSED_KERNELS
    bn = _path_choice.BATCH_NORM
    for onednn in (True, False):
        monkeypatch.setattr(_compat, "onednn_enabled", lambda v=onednn: v)
        for elements in (2**21, 2**24):  # where the rules with oneDNN differ
            path = _path_choice._graph_step_path(
                elements, False, "float32", True, unknown_batch
            )
            assert (path == formula) is (not onednn), (onednn, elements)
        # Half precision and layer norms keep their rules.
        layer_norm = _path_choice._graph_step_path(
            2**24, True, "float32", False, unknown_batch
        )
        assert layer_norm == kernels
        half = _path_choice._graph_step_path(
            2**24, False, "bfloat16", True, unknown_batch
        )
        assert half == (bn if unknown_batch else kernels)

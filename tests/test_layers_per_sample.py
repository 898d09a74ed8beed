"""Instance norm through TensorFlow's batch-norm kernel, one call per sample.

The per-sample path must match float64 references (outputs, all gradients,
second order), unrolled for a batch size known at trace time and in a loop
for any, run only where it applies (large samples, outside XLA) and be
chosen as `_path_choice` says: by the measurement where one covers the size,
else by the rule; samples larger than any measured, outright.
"""

import json
import os

import numpy as np
import pytest
import tensorflow as tf
from conftest import (
    as_float64,
    assert_close,
    check_normalization,
    float_inputs,
    normalization_reference,
    penalty_gradients,
    run_layer,
    second_order_reference,
    set_random_weights,
    use_policy,
)

from keras_amp_plus import _compat, layers
from keras_amp_plus.layers import (
    _batch_norm_formula,
    _path_calibration,
    _path_choice,
    _per_sample_batch_norm,
)

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
PER_SAMPLE = _path_choice.PER_SAMPLE_BATCH_NORM

pytestmark = pytest.mark.usefixtures("empty_path_cache")


class _GraphStep:
    """The layer in a graph step; counts kernels.

    Traced for the input's shape, or with `any_batch` for any batch size (as
    `fit` traces a `tf.data` pipeline without `drop_remainder`).
    """

    def __init__(self, layer, jit_compile=False, any_batch=False):
        self.inner = layer
        self.any_batch = any_batch
        self.call_in_step = tf.function(
            lambda x: layer(x), jit_compile=jit_compile, reduce_retracing=any_batch
        )

    def __getattr__(self, name):  # build, weights, gamma, beta, epsilon
        return getattr(self.inner, name)

    def __call__(self, x):
        return self._concrete(x)(x)

    def ops(self, x):
        """Return the op types of the step's graph for `x`, loop bodies too."""
        graph = self._concrete(x).graph
        functions = graph.as_graph_def().library.function
        body_ops = [node.op for f in functions for node in f.node_def]
        return [op.type for op in graph.get_operations()] + body_ops

    def _concrete(self, x):
        if not self.any_batch:
            return self.call_in_step.get_concrete_function(x)
        spec = tf.TensorSpec((None, *x.shape[1:]), x.dtype)
        return self.call_in_step.get_concrete_function(spec)


@pytest.mark.parametrize("any_batch", (False, True), ids=("unrolled", "loop"))
@pytest.mark.parametrize("policy_name", POLICIES)
@pytest.mark.parametrize(
    ("shape", "stat_axes"),
    (
        ((4, 8, 8, 16), (1, 2)),  # images
        ((3, 32, 8), (1,)),  # sequences (Conv1D)
        ((2, 4, 4, 4, 8), (1, 2, 3)),  # volumes (Conv3D)
    ),
)
def test_per_sample_path_matches_float64(
    policy_name, shape, stat_axes, any_batch, monkeypatch
):
    # Small samples, let through, as the other paths are checked.
    monkeypatch.setattr(_per_sample_batch_norm, "MIN_SAMPLE_ELEMENTS", 1)
    monkeypatch.setenv(_path_choice.PATH_VARIABLE, PER_SAMPLE)
    policy = use_policy(policy_name)
    params = (1,) * (len(shape) - 1) + (shape[-1],)
    for mean in (0.0, 1000.0):  # the kernel centers before it squares
        layer = _GraphStep(layers.InstanceNormalization(), any_batch=any_batch)
        check_normalization(layer, shape, mean, policy, stat_axes, params)
    ops = layer.ops(tf.zeros(shape, policy.compute_dtype))
    # One kernel per sample (one in the loop's body), on views of the input:
    # no transposes.
    assert ops.count("FusedBatchNormV3") == (1 if any_batch else shape[0])
    assert ("While" in ops or "StatelessWhile" in ops) == any_batch
    assert "Transpose" not in ops


@pytest.mark.parametrize("policy_name", POLICIES)
def test_large_samples_take_the_per_sample_path_like_float64(policy_name, monkeypatch):
    monkeypatch.setenv(_path_choice.PATH_VARIABLE, PER_SAMPLE)
    policy = use_policy(policy_name)
    compute = policy.compute_dtype
    shape, params = (2, 64, 64, 32), (1, 1, 1, 32)  # 2**17 elements per sample
    layer = layers.InstanceNormalization()
    layer.build(shape)
    set_random_weights(layer)
    step = _GraphStep(layer)
    x, upstream, x64, upstream64 = float_inputs(shape, 0.0, compute)
    ops = step.ops(x)
    assert ops.count("FusedBatchNormV3") == 2 and "Transpose" not in ops
    with tf.GradientTape() as tape:
        tape.watch(x)
        outputs = step(x)
    x_grad = tape.gradient(outputs, x, output_gradients=upstream)
    gamma = np.reshape(as_float64(layer.gamma), params)
    beta = np.reshape(as_float64(layer.beta), params)
    ref = normalization_reference(x64, upstream64, gamma, beta, 1e-3, (1, 2))
    # The kernel sums 4096 values per statistic in float32: the bound of such
    # a sum, count * 2**-24 relative, is count / 16 float32 slops.
    count_slop = 64 * 64 / 16
    assert_close(outputs, ref[0], compute, "outputs", count_slop)
    assert_close(x_grad, ref[1], compute, "x gradient", count_slop)


@pytest.mark.parametrize("batch", (0, None), ids=("known", "any"))
def test_an_empty_batch_normalizes_to_an_empty_batch(batch, monkeypatch):
    # Under tf.distribute a replica's share of a partial batch can be empty.
    monkeypatch.setenv(_path_choice.PATH_VARIABLE, PER_SAMPLE)
    monkeypatch.setattr(_per_sample_batch_norm, "MIN_SAMPLE_ELEMENTS", 1)
    use_policy("mixed_bfloat16")
    layer = layers.InstanceNormalization()
    layer.build((None, 4, 4, 8))
    step = _GraphStep(layer, any_batch=batch is None)
    x = tf.zeros([0, 4, 4, 8], tf.bfloat16)
    assert "FusedBatchNormV3" in step.ops(x)
    outputs, grads = run_layer(step, x, tf.zeros_like(x))
    assert outputs.shape == (0, 4, 4, 8) and grads[0].shape == (0, 4, 4, 8)
    for weight_grad in grads[1:]:
        np.testing.assert_array_equal(as_float64(weight_grad), np.zeros((8,)))


@pytest.mark.parametrize("any_batch", (False, True), ids=("unrolled", "loop"))
def test_per_sample_path_differentiates_twice_like_float64(any_batch, monkeypatch):
    # A gradient penalty differentiates the layer's gradient again.
    monkeypatch.setenv(_path_choice.PATH_VARIABLE, PER_SAMPLE)
    monkeypatch.setattr(_per_sample_batch_norm, "MIN_SAMPLE_ELEMENTS", 1)
    use_policy("float32")
    layer = layers.InstanceNormalization()
    layer.build((2, 4, 4, 4))
    set_random_weights(layer)
    gamma = np.reshape(as_float64(layer.gamma), (1, 1, 1, 4))
    beta = np.reshape(as_float64(layer.beta), (1, 1, 1, 4))
    step = _GraphStep(layer, any_batch=any_batch)
    x, upstream, x64, upstream64 = float_inputs((2, 4, 4, 4), 0.0, tf.float32)
    assert step.ops(x).count("FusedBatchNormV3") == (1 if any_batch else 2)
    direction = tf.random.stateless_normal(x.shape, (1, 2))
    x_grad, second = penalty_gradients(step, x, upstream, direction)
    ref = normalization_reference(x64, upstream64, gamma, beta, 1e-3, (1, 2))
    assert_close(x_grad, ref[1], "float32", "x gradient")
    expected = second_order_reference(
        x64, upstream64, as_float64(direction), gamma, beta, (1, 2)
    )
    atol = 1e-3 * np.abs(expected).max()
    np.testing.assert_allclose(as_float64(second), expected, rtol=1e-3, atol=atol)


def _applies(shape, epsilon=1e-3, dtype=tf.float32):
    x = tf.TensorSpec(shape, dtype)
    gamma = tf.TensorSpec((1,) * (len(shape) - 1) + (shape[-1],), tf.float32)
    return _per_sample_batch_norm.applies(x, gamma, epsilon, tuple(range(1, 3)))


def test_per_sample_applies_to_a_known_batch_of_large_samples():
    assert _applies((8, 64, 64, 32))  # 2**17 elements per sample
    assert _applies((8, 64, 64, 32), dtype=tf.bfloat16)
    assert _applies((None, 64, 64, 32))  # any batch size: a loop
    assert not _applies((8, 32, 32, 64))  # 2**16 per sample: calls cost more
    assert not _applies((8, 64, 64, 32), epsilon=1e-6)  # the kernel's minimum
    assert not _applies((8, 64, 64, 32), dtype=tf.float64)
    assert not _applies((8, 64, None, 32))  # the sample's size decides


@pytest.mark.parametrize("policy_name", ("float32", "mixed_bfloat16"))
def test_forced_per_sample_falls_back_where_it_cannot_run(policy_name, monkeypatch):
    monkeypatch.setenv(_path_choice.PATH_VARIABLE, PER_SAMPLE)
    policy = use_policy(policy_name)
    shape, params = (2, 64, 64, 32), (1, 1, 1, 32)
    # Small samples: the batch-norm kernel on the transposed batch.
    small = _GraphStep(layers.InstanceNormalization())
    check_normalization(small, (4, 8, 8, 16), 0.0, policy, (1, 2), (1, 1, 1, 16))
    small_ops = small.ops(tf.zeros((4, 8, 8, 16), policy.compute_dtype))
    assert small_ops.count("FusedBatchNormV3") == 1
    # Inside XLA (whose lowering of the kernel is not used): the kernels.
    xla = _GraphStep(layers.InstanceNormalization(), jit_compile=True)
    check_normalization(xla, shape, 0.0, policy, (1, 2), params)


def _choice(elements, dtype="bfloat16", per_sample=True, batch_norm=True):
    """Return the path a graph step takes for an instance norm of `elements`."""
    taken = []

    @tf.function
    def step():
        taken.append(
            _path_choice.normalization_path(
                elements, False, dtype, batch_norm, per_sample
            )
        )
        return 0

    step()
    return taken[0]


def test_unmeasured_instance_norm_takes_per_sample_from_its_size(monkeypatch):
    monkeypatch.delenv(_path_choice.PATH_VARIABLE, raising=False)
    monkeypatch.setattr(_compat, "onednn_enabled", lambda: True)
    minimum = _path_choice.PER_SAMPLE_MIN_ELEMENTS
    bn, formula = _path_choice.BATCH_NORM, _path_choice.KERAS_FORMULA
    assert _choice(minimum) == PER_SAMPLE
    assert _choice(minimum, "float32") == PER_SAMPLE
    assert _choice(minimum, per_sample=False) == bn
    assert _choice(minimum // 2) == bn  # the transposed layout was as fast
    assert _choice(minimum, batch_norm=False, per_sample=False) == formula
    # From the dot size on: per sample where it applies, else the kernels.
    large = _path_choice.DOT_SUM_MIN_ELEMENTS
    assert _choice(large) == PER_SAMPLE
    assert _choice(large, per_sample=False) == _path_choice.FUSED_KERNELS


def _write_measurements(cells):
    path = _path_calibration.cache_path()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as file:
        json.dump({"cells": cells}, file)


def test_a_measured_per_sample_winner_gives_way_where_it_cannot_run(monkeypatch):
    monkeypatch.delenv(_path_choice.PATH_VARIABLE, raising=False)
    ratios = {
        "keras_formula": 1.0,
        "fused_kernels": 0.9,
        "batch_norm": 0.6,
        PER_SAMPLE: 0.3,
    }
    cell = {"trailing": False, "elements": 2**20, "path": PER_SAMPLE}
    _write_measurements(
        [
            {**cell, "dtype": "bfloat16", "ratios": ratios},
            {**cell, "dtype": "float32"},  # hand-written: no times
        ]
    )
    assert _choice(2**20) == PER_SAMPLE
    # Samples too small (or a batch too large) for it: the race's next best.
    assert _choice(2**20, per_sample=False) == _path_choice.BATCH_NORM
    assert _choice(2**20, per_sample=False, batch_norm=False) == "keras_formula"
    # A cell without times to choose another by: the rule.
    monkeypatch.setattr(_compat, "onednn_enabled", lambda: True)
    assert _choice(2**20, "float32", per_sample=False) == "keras_formula"


def test_of_two_cells_of_one_size_the_one_raced_like_the_input_decides(monkeypatch):
    # Measured at 2**20 elements twice, as on an Intel Xeon Ice Lake: large
    # samples (the per-sample batch norm first, the batch-norm kernel second)
    # and small ones (the kernels first). Small samples follow their own.
    monkeypatch.delenv(_path_choice.PATH_VARIABLE, raising=False)
    bn, kernels = _path_choice.BATCH_NORM, _path_choice.FUSED_KERNELS
    large_samples = {
        "keras_formula": 1.0,
        kernels: 0.81,
        bn: 0.74,
        PER_SAMPLE: 0.68,
    }
    small_samples = {"keras_formula": 1.0, kernels: 0.73, bn: 0.88}
    cell = {"trailing": False, "elements": 2**20, "dtype": "float32"}
    for first, second in (
        (large_samples, small_samples),
        (small_samples, large_samples),
    ):
        _path_calibration.write_cells(  # in either order
            _path_calibration.cache_path(),
            [
                {**cell, "ratios": first, "path": min(first, key=first.get)},
                {**cell, "ratios": second, "path": min(second, key=second.get)},
            ],
        )
        assert _choice(2**20, "float32") == PER_SAMPLE
        assert _choice(2**20, "float32", per_sample=False) == kernels


def test_measure_paths_races_per_sample_where_it_applies(monkeypatch):
    monkeypatch.setattr(_path_calibration, "TRAILING_SHAPES", ())
    monkeypatch.setattr(_path_calibration, "MIDDLE_SHAPES", ((2, 4, 4, 8),))
    monkeypatch.setattr(_path_calibration, "DTYPES", ("bfloat16",))
    monkeypatch.setattr(_per_sample_batch_norm, "MIN_SAMPLE_ELEMENTS", 64)
    cells = _path_calibration.measure_paths(seconds=60.0, reps=1)["cells"]
    raced = {cell["unknown_batch"]: set(cell["ratios"]) for cell in cells}
    four = {"fused_kernels", "keras_formula", "batch_norm", PER_SAMPLE}
    assert raced == {False: four, True: four}


def test_unmeasured_any_batch_takes_the_loop_where_the_batch_norm_kernel_was(
    monkeypatch,
):
    # Traced for any batch size and measured nowhere: the batch-norm kernel's
    # side of such steps (from 2**22 elements) runs per sample, in a loop.
    monkeypatch.delenv(_path_choice.PATH_VARIABLE, raising=False)
    monkeypatch.setattr(_compat, "onednn_enabled", lambda: True)
    first_batch_norm = 2**22 // (64 * 64 * 32)
    runs = _paths((None, 64, 64, 32), "bfloat16")
    assert runs[-1] == (first_batch_norm, PER_SAMPLE)
    assert PER_SAMPLE not in [path for _, path in runs[:-1]]
    # Samples too small for it: the batch-norm kernel on the transposed batch.
    runs = _paths((None, 32, 32, 64), "bfloat16")
    assert runs[-1][1] == _path_choice.BATCH_NORM
    assert PER_SAMPLE not in [path for _, path in runs]


@pytest.mark.parametrize("any_batch", (False, True), ids=("its batch", "any batch"))
def test_large_samples_run_per_sample_whatever_was_measured(any_batch, monkeypatch):
    # The measured cells have at most 2**17 elements per sample, where the
    # race is close; larger samples run per sample, measured or not.
    monkeypatch.delenv(_path_choice.PATH_VARIABLE, raising=False)
    kernels = _path_choice.FUSED_KERNELS
    cell = {"trailing": False, "path": kernels, "unknown_batch": any_batch}
    cells = [
        {**cell, "elements": 2**e, "dtype": d, "ratios": {"keras_formula": 1.0}}
        for e in (20, 22, 24)
        for d in ("bfloat16", "float32")
    ]
    _write_measurements(cells)
    large = _path_choice.LARGE_SAMPLE_ELEMENTS
    batch = None if any_batch else 8
    for dtype in ("bfloat16", "float16", "float32"):
        assert _paths((batch, large // 64, 64), dtype) == ((1, PER_SAMPLE),)
    for dtype in ("bfloat16", "float32"):  # float16 may follow its own rule
        # Half that size: the measurement (where one lies near).
        assert _paths((batch, large // 128, 64), dtype)[0] == (1, kernels)
    # A forced path and XLA still decide.
    monkeypatch.setenv(_path_choice.PATH_VARIABLE, kernels)
    assert _paths((batch, large // 64, 64), "bfloat16") == ((1, kernels),)
    monkeypatch.delenv(_path_choice.PATH_VARIABLE)
    xla = _paths((batch, large // 64, 64), "bfloat16", jit_compile=True)
    assert xla == ((1, _path_choice.KERAS_FORMULA),)


def _paths(shape, dtype, jit_compile=False):
    """Return `paths_by_batch_size` of an instance norm of `shape`, in a step."""
    x = tf.TensorSpec(shape, dtype)
    gamma = tf.TensorSpec((1,) * (len(shape) - 1) + (shape[-1],), tf.float32)
    stat_axes = tuple(range(1, len(shape) - 1))
    applies = (
        _batch_norm_formula.applies(x, gamma, 1e-3, stat_axes),
        _per_sample_batch_norm.applies(x, gamma, 1e-3, stat_axes),
    )
    taken = []

    @tf.function(jit_compile=jit_compile)
    def step():
        taken.append(_path_choice.paths_by_batch_size(x.shape, False, dtype, *applies))
        return 0

    step()
    return taken[0]

"""The scaler's finite flags: exact on every step, though read from sums.

A finite sum proves a gradient finite; a sum that overflows proves nothing, and
there the exact `is_finite` flags must be taken. Each case is checked against
NumPy's `isfinite` of the same values in float64, eagerly, in a graph step and
inside an XLA-compiled step.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_amp_plus.optimizers import LossScaleOptimizer, _finite_flags

NAN, INF = float("nan"), float("inf")
# Finite values whose sum overflows the dtype's largest value.
NEAR_MAX = {"float16": 6e4, "bfloat16": 3e38, "float32": 3e38, "float64": 1.7e308}
RUNS = ("eager", "graph", "xla")


@pytest.fixture(params=["sums", "exact"])
def check(request, monkeypatch):
    """Run a test with sums read first (any size), and with the exact check only.

    The gradients here are small: at the default `SUMS_MIN_ELEMENTS` they would
    take the exact check alone, so "sums" lowers it to 0.
    """
    if request.param == "sums":
        monkeypatch.setattr(_finite_flags, "SUMS_MIN_ELEMENTS", 0)
    else:
        monkeypatch.setattr(_finite_flags, "SUMS_MIN_ELEMENTS", 2**62)
    return request.param


def run_flags(run, grads, positions, num_tracked):
    def flags(grads):
        return _finite_flags.finite_flags(grads, positions, num_tracked)

    if run == "eager":
        return flags(grads).numpy().tolist()
    function = tf.function(flags, jit_compile=run == "xla")
    return function(grads).numpy().tolist()


def gradient_cases(dtype):
    """Return {name: float64 values} of one gradient each."""
    big = NEAR_MAX[dtype]
    return {
        "finite": [0.5, -2.0, 3.0],
        "inf": [0.5, INF, 3.0],
        "minus_inf": [-INF, 1.0, 1.0],
        "nan": [1.0, 2.0, NAN],
        "inf_and_minus_inf": [INF, -INF, 1.0],
        "sum_overflows": [big, big, big],
        "sum_overflows_and_nan": [big, big, NAN],
    }


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_flags_equal_numpy_isfinite_for_every_case_at_once(run, dtype, check):
    cases = gradient_cases(dtype)
    grads = [tf.constant(values, dtype) for values in cases.values()]
    # The reference is NumPy's, of the values as the dtype holds them.
    held = [tf.cast(g, tf.float64).numpy() for g in grads]
    expected = [bool(np.isfinite(values).all()) for values in held]
    positions = list(range(len(grads)))
    assert run_flags(run, grads, positions, len(grads)) == expected


@pytest.mark.parametrize("run", RUNS)
@pytest.mark.parametrize("case", list(gradient_cases("float32")))
def test_each_case_alone_beside_finite_gradients(run, case, check):
    # Alone, a sum that overflows is the only non-finite sum of the step:
    # the exact branch must still clear it.
    values = gradient_cases("float32")[case]
    grads = [tf.ones([2, 3]), tf.constant(values), tf.zeros([4])]
    flags = run_flags(run, grads, [0, 1, 2], 3)
    assert flags == [True, bool(np.isfinite(values).all()), True]


@pytest.mark.parametrize("run", RUNS)
def test_missing_and_untracked_gradients_keep_their_places(run, check):
    grads = [tf.constant([INF]), None, tf.constant([NAN]), tf.constant([1.0])]
    # tracked variables 0..2: the first gradient is variable 2, the second
    # (None) variable 0, the third untracked, the fourth variable 1.
    flags = run_flags(run, grads, [2, 0, None, 1], 3)
    assert flags == [True, True, False, False]


def test_indexed_slices_are_checked_by_their_rows(check):
    rows = tf.constant([[1.0, 2.0], [3e38, 3e38]])
    finite = tf.IndexedSlices(rows, tf.constant([0, 3]), tf.constant([5, 2]))
    bad = tf.IndexedSlices(
        tf.constant([[1.0, NAN]]), tf.constant([1]), tf.constant([5, 2])
    )
    assert _finite_flags.finite_flags([finite, bad], [0, 1], 2).numpy().tolist() == [
        True,
        False,
    ]


def test_arrays_lists_and_variables_are_taken_as_gradients(check):
    # `apply()` hands its gradients through unconverted.
    grads = [np.array([1.0, NAN]), [2.0, 3.0], keras.Variable([INF, 1.0])]
    flags = _finite_flags.finite_flags(grads, [0, 1, 2], 3)
    assert flags.numpy().tolist() == [False, True, False]


def test_no_gradients_give_an_empty_vector(check):
    assert _finite_flags.finite_flags([], [], 0).shape == (0,)
    assert _finite_flags.finite_flags([None], [0], 1).numpy().tolist() == [True]


@pytest.mark.parametrize("run", RUNS)
def test_a_step_of_huge_finite_gradients_is_applied_not_skipped(run, check):
    # Regression guard: a check on sums alone would call this step an overflow
    # (3e38 + 3e38 is Inf in float32) and skip it. (A learning rate of 1e-38
    # would be flushed to zero: TensorFlow's kernels drop float32 denormals.)
    variable = keras.Variable([1.0, 2.0])
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(1e-36), initial_scale=1.0, on_min_scale="ignore"
    )
    optimizer.build([variable])

    def step(gradient):
        optimizer.apply([gradient], [variable])

    if run != "eager":
        step = tf.function(step, jit_compile=run == "xla")
    step(tf.constant([3e38, 3e38]))
    assert int(optimizer.last_step_skipped.numpy()) == 0
    assert int(optimizer.overflow_count.numpy()) == 0
    np.testing.assert_allclose(variable.numpy(), [1.0 - 300.0, 2.0 - 300.0], rtol=1e-5)
    step(tf.constant([3e38, INF]))
    assert int(optimizer.last_step_skipped.numpy()) == 1
    assert int(optimizer.overflow_count.numpy()) == 1
    np.testing.assert_allclose(variable.numpy(), [-299.0, -298.0], rtol=1e-5)


def test_sums_are_read_first_from_the_size_threshold_on():
    def op_types(grads):
        graph = (
            tf.function(lambda *g: _finite_flags.finite_flags(list(g), [0, 1], 2))
            .get_concrete_function(*grads)
            .graph
        )
        return {op.type for op in graph.get_operations()}

    below = [tf.TensorSpec([8, 8]), tf.TensorSpec([8])]
    at = [tf.TensorSpec([_finite_flags.SUMS_MIN_ELEMENTS]), tf.TensorSpec([1])]
    unknown = [tf.TensorSpec([None, 8]), tf.TensorSpec([8])]
    assert "Sum" not in op_types(below)
    assert {"Sum", "IsFinite"} <= op_types(at)
    assert "Sum" in op_types(unknown)

"""The run-time switch's own parts: its branch lookup and saved-tensor ranks."""

import numpy as np
import pytest
import tensorflow as tf

from keras_amp_plus.layers import _size_switch

FACTOR = {"a": 1.0, "b": 2.0, "c": 3.0, "d": 4.0}
# The layout of an instance norm of any image size (`paths_by_sample_size`),
# its thresholds scaled down: rows by sample size, runs by input size, a path
# coming back in a later run and a last row of one path.
PATHS = (
    (1, ((1, "a"), (12, "b"), (40, "c"))),
    (6, ((1, "a"), (12, "b"), (30, "c"), (50, "d"), (70, "c"), (90, "d"))),
    (16, ((1, "d"),)),
)


def _forward(path, x, gamma, beta):
    return FACTOR[path] * x, (gamma, gamma, gamma)


def _backward(path, upstream, x, gamma, saved):
    return FACTOR[path] * upstream, 0 * gamma, 0 * gamma


def _expected_path(batch, sample):
    """The path the runs give, read as a user would read the table."""
    runs = [runs for first, runs in PATHS if first <= sample][-1]
    return [path for first, path in runs if first <= batch * sample][-1]


def test_each_input_size_takes_its_runs_path():
    ones, zeros = tf.ones([1, 1, 1]), tf.zeros([1, 1, 1])
    step = tf.function(
        lambda x: _size_switch.switch_on_sample_size(
            x, ones, zeros, PATHS, _forward, _backward
        ),
        input_signature=[tf.TensorSpec([None, None, 1])],
    )
    for batch in range(1, 8):
        for sample in range(1, 20):
            taken = float(step(tf.ones([batch, sample, 1]))[0, 0, 0])
            assert taken == FACTOR[_expected_path(batch, sample)], (batch, sample)


@pytest.mark.parametrize(
    "signature, value_shape, rank",
    [
        ([None, 4], (3, 4), 4),  # partly known: padded at run time
        ([2, 4], (2, 4), 4),  # fully known: one reshape of constant shape
        ([None, 1, 1, 4], (3, 1, 1, 4), 4),  # the rank already: as it is
        (None, (5,), 4),  # unknown rank (a workspace): flat
    ],
)
def test_saved_tensors_leave_a_branch_at_one_rank_and_come_back(
    signature, value_shape, rank
):
    spec = tf.TensorSpec(signature, tf.float32)

    @tf.function(input_signature=[spec])
    def round_trip(tensor):
        padded = _size_switch._to_rank(tensor, rank)
        assert padded.shape.rank == rank
        back = _size_switch._from_rank(padded, tensor.shape)
        if signature is not None:  # its static shape is back
            assert back.shape.as_list() == tensor.shape.as_list()
        return padded, back

    value = np.arange(np.prod(value_shape), dtype="float32").reshape(value_shape)
    padded, back = round_trip(tf.constant(value))
    assert padded.shape.rank == rank
    np.testing.assert_array_equal(np.ravel(padded), np.ravel(value))
    np.testing.assert_array_equal(
        back, value if signature is not None else np.ravel(value)
    )


def test_a_saved_tensor_above_the_rank_is_refused():
    with pytest.raises(ValueError, match="higher rank than the switch passes on"):
        _size_switch._to_rank(tf.zeros([1, 1, 1, 1, 2]), 4)

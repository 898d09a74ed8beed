"""Instance normalization as TensorFlow's fused batch-norm kernel.

Statistics per sample and channel over the middle axes of a channels-last
input (`(N, H, W, C)`, normalized over H and W) are a batch norm's statistics
of a tensor whose channels are the N * C (sample, channel) pairs: moving the
batch axis next to the channels, `(H, W, N, C)` reshaped to
`(1, H * W, 1, N * C)`, turns one into the other. TensorFlow's
`FusedBatchNormV3` (oneDNN's kernel where oneDNN is on, Eigen's elsewhere)
then computes forward and backward in one pass each, with float32 statistics
for bfloat16 and float16 inputs, instead of the dozen ops of Keras's formula
and its gradient. The two transposes cost one copy each way. float16 inputs
on a CPU without float16 arithmetic run the float32 kernel, widened after the
transpose and rounded before the one back (`_precision.kernel_dtype`). Where
it beats the other paths is measured (`_path_calibration`).
"""

import tensorflow as tf

from keras_amp_plus.layers import _precision

# The kernel raises epsilon to this minimum (cuDNN's); smaller ones would
# change the result, so such layers take another path.
MIN_EPSILON = 1.001e-5
_DTYPES = (tf.bfloat16, tf.float16, tf.float32)


def applies(x, gamma, epsilon, stat_axes) -> bool:
    """Return True when `x` can be normalized by the batch-norm kernel.

    That is for statistics over all axes between the batch axis and a last,
    known-size channels axis, per-channel weights, an input dtype the kernel
    takes (bfloat16, float16, float32: not float64), and `epsilon` at least
    `MIN_EPSILON`.
    """
    rank = x.shape.rank
    return (
        rank is not None
        and rank >= 3
        and tuple(stat_axes) == tuple(range(1, rank - 1))
        and x.shape[-1] is not None
        and x.dtype in _DTYPES
        and gamma.dtype == tf.float32
        and all(gamma.shape[axis] == 1 for axis in range(rank - 1))
        and epsilon >= MIN_EPSILON
    )


def batch_norm_normalize(x, gamma, beta, epsilon, stat_axes, output_dtype):
    """Return the instance-normalized `x`; see `fused_normalize`.

    Args:
        x: a channels-last tensor with `applies(x, gamma, epsilon,
            stat_axes)` True.
        gamma: the per-channel scale, shape `(1, ..., 1, C)`, float32.
        beta: the per-channel offset, like `gamma`.
        epsilon: positive float added to the variance.
        stat_axes: the middle axes `(1, ..., rank - 2)`.
        output_dtype: the dtype of the result.

    Example:
    >>> import tensorflow as tf
    >>> x = tf.constant([[[[1000.0]], [[1002.0]]]])  # (1, 2, 1, 1)
    >>> ones, zeros = tf.ones([1, 1, 1, 1]), tf.zeros([1, 1, 1, 1])
    >>> out = batch_norm_normalize(x, ones, zeros, 1e-3, (1, 2), tf.float32)
    >>> [round(float(v), 2) for v in tf.reshape(out, [-1])]
    [-1.0, 1.0]
    """
    outputs, _ = batch_norm_forward(x, gamma, beta, epsilon, stat_axes, output_dtype)
    return outputs


def batch_norm_forward(x, gamma, beta, epsilon, stat_axes, output_dtype):
    """Return `(outputs, saved)`: `batch_norm_normalize` and what its gradient reads.

    `saved` is the kernel's three reserve spaces (float32), which
    `batch_norm_backward` hands to the gradient kernel as TensorFlow's own
    gradient of the op does.
    """
    del stat_axes  # always the middle axes (`applies`)
    outputs, _, _, *saved = tf.raw_ops.FusedBatchNormV3(
        x=_kernel_pairs(x, x),
        scale=_per_pair(gamma, x),
        offset=_per_pair(beta, x),
        mean=tf.constant([], tf.float32),
        variance=tf.constant([], tf.float32),
        epsilon=epsilon,
        exponential_avg_factor=1.0,
        data_format="NHWC",
        is_training=True,
    )
    return _from_pairs(tf.cast(outputs, output_dtype), x), tuple(saved)


def batch_norm_backward(upstream, x, gamma, saved, epsilon, stat_axes):
    """Return the gradients w.r.t. (x, gamma, beta) of `batch_norm_forward`."""
    del stat_axes
    x_grad, gamma_grad, beta_grad, _, _ = tf.raw_ops.FusedBatchNormGradV3(
        y_backprop=_kernel_pairs(upstream, x),
        x=_kernel_pairs(x, x),
        scale=_per_pair(gamma, x),
        reserve_space_1=saved[0],
        reserve_space_2=saved[1],
        reserve_space_3=saved[2],
        epsilon=epsilon,
        data_format="NHWC",
        is_training=True,
    )
    return (
        _from_pairs(tf.cast(x_grad, x.dtype), x),
        _per_channel_sum(gamma_grad, gamma),
        _per_channel_sum(beta_grad, gamma),
    )


def _per_channel_sum(pair_values, weight):
    """Sum the kernel's `(N * C,)` per-pair values over the samples, as `weight`."""
    channels = tf.size(weight)
    per_sample = tf.reshape(pair_values, tf.stack([-1, channels]))
    return tf.reshape(tf.reduce_sum(per_sample, axis=0), tf.shape(weight))


def _to_pairs(x):
    """(N, S..., C) -> (1, prod(S), 1, N * C): the (sample, channel) pairs last."""
    rank = x.shape.rank
    order = [*range(1, rank - 1), 0, rank - 1]
    pairs = tf.stack([1, -1, 1, tf.shape(x)[0] * x.shape[-1]])
    return tf.reshape(tf.transpose(x, order), pairs)


def _kernel_pairs(tensor, x):
    """Return `_to_pairs(tensor)` in the kernel's dtype for inputs like `x`.

    Cast after the transpose: a float16 copy moves half the bytes.
    """
    return tf.cast(_to_pairs(tensor), _precision.kernel_dtype(x.dtype))


def _from_pairs(pairs, x):
    """Return `pairs` as `x` was before `_to_pairs`."""
    rank = x.shape.rank
    dims = tf.shape(x)
    spatial = tf.gather(dims, list(range(1, rank - 1)))
    grouped = tf.reshape(pairs, tf.concat([spatial, [dims[0], x.shape[-1]]], axis=0))
    outputs = tf.transpose(grouped, [rank - 2, *range(rank - 2), rank - 1])
    outputs.set_shape(x.shape)
    return outputs


def _per_pair(weight, x):
    """Return a per-channel weight repeated per sample: one value per pair."""
    return tf.tile(tf.reshape(weight, [x.shape[-1]]), tf.shape(x)[:1])

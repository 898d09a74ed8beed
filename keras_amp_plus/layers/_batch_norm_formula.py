"""Instance normalization as TensorFlow's fused batch-norm kernel.

Statistics per sample and channel over the middle axes of a channels-last
input (`(N, H, W, C)`, normalized over H and W) are a batch norm's statistics
of a tensor whose channels are the N * C (sample, channel) pairs: moving the
batch axis next to the channels, `(H, W, N, C)` reshaped to
`(1, H * W, 1, N * C)`, turns one into the other. TensorFlow's
`FusedBatchNormV3` (oneDNN's kernel where oneDNN is on, Eigen's elsewhere)
then computes forward and backward in one pass each, with float32 statistics
for bfloat16 and float16 inputs, instead of the dozen ops of Keras's formula
and its gradient. The two transposes cost one copy each way. Where it beats
the other paths is measured (`_path_calibration`).
"""

import tensorflow as tf

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
    rank = x.shape.rank
    channels = x.shape[-1]
    dims = tf.shape(x)
    batch = dims[0]
    # (N, S..., C) -> (S..., N, C): the (sample, channel) pairs last.
    order = [*range(1, rank - 1), 0, rank - 1]
    pairs = tf.reshape(tf.transpose(x, order), tf.stack([1, -1, 1, batch * channels]))
    outputs, _, _ = tf.compat.v1.nn.fused_batch_norm(
        pairs,
        tf.tile(tf.reshape(gamma, [channels]), [batch]),
        tf.tile(tf.reshape(beta, [channels]), [batch]),
        epsilon=epsilon,
        is_training=True,
    )
    spatial = tf.gather(dims, list(range(1, rank - 1)))
    outputs = tf.reshape(outputs, tf.concat([spatial, [batch, channels]], axis=0))
    inverse = [rank - 2, *range(rank - 2), rank - 1]
    outputs = tf.transpose(outputs, inverse)
    outputs.set_shape(x.shape)
    return tf.cast(outputs, output_dtype)

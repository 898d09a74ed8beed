"""Instance normalization as row statistics: channels first, then rows.

Statistics over the middle axes of a channels-last input `(N, S..., C)` are
the row statistics of its transpose `(N, C, S...)` flattened to
`(N * C, prod(S))`, with `gamma` and `beta` repeated per sample as one value
per row. There the fused kernels take every row's sums as a product with a
ones column, one GEMM call, which from `_path_choice.DOT_SUM_MIN_ELEMENTS`
elements on beats XLA's reductions over the middle axes despite the
transposes (one copy each way, TensorFlow's, outside the kernels); below it
the kernels run in place (`_fused_normalization._by_size`).
"""

import tensorflow as tf


def applies(x, gamma, stat_axes) -> bool:
    """Return True for channels-last statistics over every middle axis.

    That is when `stat_axes` are all axes between the batch axis and the
    last one, and `gamma` varies over the last axis only.
    """
    rank = x.shape.rank
    return (
        rank is not None
        and rank >= 3
        and tuple(stat_axes) == tuple(range(1, rank - 1))
        and all(gamma.shape[axis] == 1 for axis in range(rank - 1))
    )


def normalize_as_rows(normalize, x, gamma, beta):
    """Apply `normalize(rows, gamma_rows, beta_rows, stat_axes=(1,))` per channel.

    Args:
        normalize: the normalization of a rank-2 `(rows, features)` input
            over its features, with per-row `(rows, 1)` weights.
        x: the channels-last input, with `applies(x, gamma, stat_axes)` True.
            Unknown (None) dimensions are read at run time.
        gamma: the per-channel scale, shape `(1, ..., 1, C)`.
        beta: the per-channel offset, like `gamma`.

    Returns:
        The normalized `x`, in its shape.

    Example:
    >>> import tensorflow as tf
    >>> def standardize(rows, gamma, beta, stat_axes):
    ...     mean, variance = tf.nn.moments(rows, stat_axes, keepdims=True)
    ...     return (rows - mean) * tf.math.rsqrt(variance) * gamma + beta
    >>> x = tf.constant([[[1.0, 10.0], [3.0, 30.0]]])  # (1, 2, 2)
    >>> ones, zeros = tf.ones([1, 1, 2]), tf.zeros([1, 1, 2])
    >>> out = normalize_as_rows(standardize, x, ones, zeros)
    >>> out.numpy().tolist()
    [[[-1.0, -1.0], [1.0, 1.0]]]
    """
    samples = tf.shape(x)[0]
    rows = to_rows(x)
    outputs = normalize(rows, per_row(gamma, samples), per_row(beta, samples), (1,))
    return from_rows(outputs, x)


def to_rows(x):
    """(N, S..., C) -> (N * C, prod(S)): one row per sample and channel."""
    rank = x.shape.rank
    dims = tf.shape(x)
    channels_first = tf.transpose(x, [0, rank - 1, *range(1, rank - 1)])
    return tf.reshape(channels_first, tf.stack([dims[0] * dims[-1], -1]))


def from_rows(rows, x):
    """Return `rows` as `x` was before `to_rows`."""
    rank = x.shape.rank
    channels_first = [0, rank - 1, *range(1, rank - 1)]
    grouped = tf.reshape(rows, tf.gather(tf.shape(x), channels_first))
    outputs = tf.transpose(grouped, [0, *range(2, rank), 1])
    outputs.set_shape(x.shape)
    return outputs


def per_row(weight, samples):
    """Return a per-channel weight as one value per row of `to_rows`."""
    per_sample = tf.tile(tf.reshape(weight, [1, -1]), tf.stack([samples, 1]))
    return tf.reshape(per_sample, [-1, 1])


def per_channel_sum(row_values, weight):
    """Sum one value per (sample, channel) over the samples, shaped as `weight`.

    The values in `to_rows` order (sample-major), in any shape: the rows'
    `(N * C, 1)` or the batch-norm kernel's `(N * C,)` pairs.
    """
    channels = tf.size(weight)
    per_sample = tf.reshape(row_values, tf.stack([-1, channels]))
    return tf.reshape(tf.reduce_sum(per_sample, axis=0), tf.shape(weight))

"""Bounded XLA recompilation for layers fed variable-length inputs.

XLA compiles one kernel per concrete input shape. A model built for inputs
whose length changes every batch (`keras.Input((None, features))`, text padded
per batch) would compile the forward and backward kernels again for every new
length, and the count keeps growing with the number of distinct lengths (its
compile time soon dwarfs the training). Such inputs are flattened to (rows,
features) and the rows padded with zeros up to one of two sizes per power of
two (at most 50% padding), so the number of kernels grows with the logarithm
of the longest length only. The padded rows normalize to `beta` and are
sliced off; their upstream gradient is zero, so they add nothing to the weight
gradients. `Swish` pads its flattened input the same way (`flat_padded`). The
padding costs a copy where the size is not a bucket, paid to stop the
compilations.
"""

import math

import tensorflow as tf

from keras_amp_plus import _compat

# Sizes per power of two, as bits: rows are rounded up to a multiple of
# 2**(k - 1) where 2**k <= rows < 2**(k + 1), which pads at most 50%. One,
# two and four sizes per power of two ran at the same speed once compiled;
# two bound the padding (memory) at 50% with half the compilations of four.
_BUCKET_FRACTION_BITS = 1


def bucket_rows(rows):
    """Return the padded row count for `rows` (an integer tensor, any shape).

    The result is `rows` rounded up to a multiple of
    `2**(floor(log2(rows)) - 1)`: at most 50% larger, and one of two values
    between consecutive powers of two.
    """
    # int64: a flattened activation can hold more than 2**31 elements.
    rows = tf.maximum(tf.cast(rows, tf.int64), 1)
    # + 0.5 keeps exact powers of two clear of float rounding in log2.
    octave = tf.math.floor(tf.math.log(tf.cast(rows, tf.float64) + 0.5) / math.log(2))
    exponent = tf.maximum(tf.cast(octave, tf.int64) - _BUCKET_FRACTION_BITS, 0)
    step = tf.bitwise.left_shift(tf.ones_like(rows), exponent)
    return (rows + step - 1) // step * step


def shapes_vary(x) -> bool:
    """Return True when `x`'s shape may change from step to step.

    That is when, at trace time, a dimension other than the batch axis is
    unknown, or the rank is. A model that XLA compiles whole recompiles per
    shape anyway, so there padding would only cost. Eager calls have their
    shapes, and run plain ops (`fused_normalize`).
    """
    if tf.executing_eagerly():
        return False
    unknown = x.shape.rank is None or any(size is None for size in x.shape[1:])
    return unknown and not _compat.in_xla_compiled_function()


def applies(x, gamma, stat_axes) -> bool:
    """Return True when `x` should be normalized in padded row buckets.

    That is when its shape varies (`shapes_vary`) in front of the statistics'
    axes, those are the trailing axes with known sizes, and `gamma` varies
    over those axes only.
    """
    rank = x.shape.rank
    first = rank - len(stat_axes)
    return (
        tuple(stat_axes) == tuple(range(first, rank))
        and all(x.shape[axis] is not None for axis in stat_axes)
        and all(gamma.shape[axis] == 1 for axis in range(first))
        and any(x.shape[axis] is None for axis in range(1, first))
        and shapes_vary(x)
    )


def flat_padded(x):
    """Return `x` flattened and padded with zeros to its size's bucket.

    Args:
        x: a tensor of any shape, typically one with `shapes_vary(x)` True.

    Returns:
        A rank-1 tensor of `bucket_rows(size)` elements, `x`'s first. Where the
        size is a bucket already, it is `x`'s own buffer (TensorFlow's `Pad`
        forwards an input it does not grow): no copy.
    """
    return padded_rows(tf.reshape(x, [-1]))


def padded_rows(x):
    """Return `x` padded with zeros along axis 0 to its row count's bucket."""
    rows = tf.shape(x, out_type=tf.int64)[0]
    paddings = [[0, bucket_rows(rows) - rows]] + [[0, 0]] * (x.shape.rank - 1)
    return tf.pad(x, paddings)


def leading_slice(padded, size):
    """Return `padded[:size]`, whose gradient pads instead of scattering.

    The gradient of a plain slice is `StridedSliceGrad`, which fills a zero
    tensor of the padded size and copies the upstream gradient into it,
    several times the CPU time of `tf.pad`. Here it is
    `tf.pad` (differentiable again: its own gradient is a slice). TensorFlow
    returns the slice itself as a view, no copy, where it stays aligned
    (`EIGEN_MAX_ALIGN_BYTES`, 64 in the x86 wheels): for a rank-1 tensor,
    where the kept bytes are a multiple of it; for a higher rank, where one
    row's bytes are.

    Args:
        padded: a tensor of rank 1 or more.
        size: the number of leading entries (along axis 0) to keep, an
            integer or integer tensor.

    Returns:
        `padded[:size]`.
    """
    size = tf.cast(size, tf.int64)

    @tf.custom_gradient
    def leading(padded):
        def grad(upstream):
            extra = tf.shape(padded, out_type=tf.int64)[0] - size
            paddings = [[0, extra]] + [[0, 0]] * (padded.shape.rank - 1)
            return tf.pad(upstream, paddings)

        return padded[:size], grad

    return leading(padded)


def unpadded(flat, like):
    """Return the first elements of the rank-1 `flat` in the shape of `like`.

    The inverse of `flat_padded(like)` (`leading_slice`).
    """
    size = tf.size(like, out_type=tf.int64)
    outputs = tf.reshape(leading_slice(flat, size), tf.shape(like))
    outputs.set_shape(like.shape)
    return outputs


def in_padded_rows(normalize):
    """Return `normalize` on `(rows, features)` inputs padded to a row bucket.

    Args:
        normalize: the normalization of a rank-2 `(rows, features)` input
            over its features, `normalize(rows, gamma, beta, stat_axes)`.

    Returns:
        The same function, run on the rows padded with zeros up to
        `bucket_rows(rows)` and sliced back (`_feature_rows` flattens the
        input to rows).

    Example:
    >>> import tensorflow as tf
    >>> shapes = []
    >>> def record(rows, gamma, beta, stat_axes):
    ...     shapes.append(tuple(rows.shape))
    ...     return rows
    >>> out = in_padded_rows(record)(tf.ones([5, 2]), 1.0, 0.0, (1,))
    >>> shapes, tuple(out.shape)
    ([(6, 2)], (5, 2))
    """

    def normalize_padded(x_rows, gamma, beta, stat_axes):
        rows = tf.shape(x_rows, out_type=tf.int64)[0]
        padded = padded_rows(x_rows)
        return leading_slice(normalize(padded, gamma, beta, stat_axes), rows)

    return normalize_padded

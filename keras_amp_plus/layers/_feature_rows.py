"""Layer normalization as a `(rows, features)` matrix: leading axes flattened.

Statistics over the trailing axes of a `(batch, sequence, features)` input
(as a transformer feeds its layer norms) are those of the rows of its
`(batch * sequence, features)` reshape, a view of the same memory. Every
implementation computes the same result either way, but not at the same
speed: XLA reduces the weights' gradients over two leading axes in a slower
loop than over one. Flattened, both the fused kernels and Keras's formula
ran faster inside XLA-compiled steps, and the kernels in graph steps too
(`benchmarks/layers.py` feeds its layer-norm cells this way;
`benchmarks/README.md` has the figures).
"""

import math

import tensorflow as tf


def applies(x, gamma, stat_axes) -> bool:
    """Return True when `x` is not rows yet and can be normalized as rows.

    That is when the statistics are taken over trailing axes of known size,
    after at least one leading axis, `gamma` varies over those axes only, and
    `x` has more than one leading axis or more than one statistics axis.
    """
    rank = x.shape.rank
    if rank is None:
        return False
    first = rank - len(stat_axes)
    return (
        first >= 1
        and tuple(stat_axes) == tuple(range(first, rank))
        and all(x.shape[axis] is not None for axis in stat_axes)
        and all(gamma.shape[axis] == 1 for axis in range(first))
        and (first > 1 or len(stat_axes) > 1)
    )


def normalize_as_rows(normalize, x, gamma, beta, stat_axes):
    """Apply `normalize(rows, gamma_row, beta_row, stat_axes=(1,))` to `x`.

    Args:
        normalize: the normalization of a rank-2 `(rows, features)` input
            over its features, with `(1, features)` weights.
        x: the input, with `applies(x, gamma, stat_axes)` True. Unknown
            (None) leading dimensions are read at run time.
        gamma: the scale, broadcastable against `x`.
        beta: the offset, same shape as `gamma`.
        stat_axes: the trailing axes the statistics are taken over.

    Returns:
        The normalized `x`, in its shape.

    Example:
    >>> import tensorflow as tf
    >>> seen = []
    >>> def record(rows, gamma, beta, stat_axes):
    ...     seen.append((tuple(rows.shape), tuple(gamma.shape), stat_axes))
    ...     return rows * gamma + beta
    >>> ones, zeros = tf.ones([1, 1, 4]), tf.zeros([1, 1, 4])
    >>> out = normalize_as_rows(record, tf.ones([2, 3, 4]), ones, zeros, (2,))
    >>> seen, tuple(out.shape)
    ([((6, 4), (1, 4), (1,))], (2, 3, 4))
    """
    features = math.prod(x.shape[axis] for axis in stat_axes)
    outputs = normalize(
        tf.reshape(x, [-1, features]),
        tf.reshape(gamma, [1, features]),
        tf.reshape(beta, [1, features]),
        (1,),
    )
    outputs = tf.reshape(outputs, tf.shape(x))
    outputs.set_shape(x.shape)
    return outputs

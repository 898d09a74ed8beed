"""Rounding float32 results to bfloat16 inside XLA kernels, by integer arithmetic."""

import tensorflow as tf

# Round to nearest, ties to even: add 0x7FFF plus the lowest kept bit, then
# drop the 16 low bits. In the integer order of IEEE bit patterns this is
# exact for every finite float32, denormals included, and carries values past
# bfloat16's largest finite one into infinity, as rounding must.
_HALF_ULP_BELOW = 0x7FFF
_DROPPED_BITS = 16
# A quiet NaN with no payload: the bias could carry a NaN whose payload
# lies in the dropped bits into infinity (or past the sign bit).
_BFLOAT16_NAN_BITS = 0x7FC0


def rounded_to(values, dtype):
    """Return float32 `values` rounded (to nearest even) to `dtype`.

    `tf.cast`, except to bfloat16: there XLA's CPU conversion runs slower
    than rounding the bit pattern with vectorized integer arithmetic
    (`benchmarks/swish_xla.py`), which gives the same result for every
    float32, NaN for NaN. Meant for XLA-compiled kernels, where these
    integer ops fuse into the producing loop; outside XLA, each would run
    as an op of its own, so callers there use `tf.cast`.

    Args:
        values: a float32 tensor.
        dtype: the dtype to round to (a `tf.DType` or its name).

    Returns:
        `values` in `dtype`.

    Example:
    >>> import numpy as np
    >>> values = tf.constant([1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, np.inf, np.nan])
    >>> print(np.asarray(rounded_to(values, "bfloat16"), "float32"))
    [1.       1.015625      inf      nan]
    """
    dtype = tf.as_dtype(dtype)
    if dtype != tf.bfloat16 or values.dtype != tf.float32:
        return tf.cast(values, dtype)
    bits = tf.bitcast(values, tf.uint32)
    shift = tf.constant(_DROPPED_BITS, tf.uint32)
    lowest_kept_bit = tf.bitwise.bitwise_and(tf.bitwise.right_shift(bits, shift), 1)
    kept = tf.bitwise.right_shift(bits + _HALF_ULP_BELOW + lowest_kept_bit, shift)
    nan_bits = tf.constant(_BFLOAT16_NAN_BITS, tf.uint32)
    kept = tf.where(tf.math.is_nan(values), nan_bits, kept)
    return tf.bitcast(tf.cast(kept, tf.uint16), tf.bfloat16)

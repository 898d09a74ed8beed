"""Rounding float32 to bfloat16 by integer arithmetic: against float64 distances."""

import numpy as np
import pytest
import tensorflow as tf

from keras_amp_plus.layers import _rounding

# Bit patterns where rounding is delicate: zeros, ties to even either way,
# carries into the next exponent, denormals, the largest finite values (one
# rounds to infinity), infinities, and NaNs whose payload lies only in the
# dropped bits (a carry would make them infinity or flip the sign).
SPECIAL_BITS = (
    0x00000000,
    0x80000000,
    0x3F808000,  # 1 + 2**-8: a tie, rounds down to the even 1.0
    0x3F818000,  # 1 + 3 * 2**-8: a tie, rounds up to the even neighbour
    0x3F808001,  # just above a tie: up
    0x3FFFFFFF,  # carries into the next exponent
    0x00000001,  # the smallest denormal: to zero
    0x00008000,  # a denormal tie: to the even zero
    0x00018000,  # a denormal tie: up
    0x007FFFFF,  # the largest denormal: to the smallest normal
    0x7F7F7FFF,  # below the overflow tie: the largest finite bfloat16
    0x7F7F8000,  # the overflow tie: to infinity (the even neighbour)
    0x7F7FFFFF,  # float32's largest: to infinity
    0xFF7FFFFF,
    0x7F800000,
    0xFF800000,
    0x7FC00000,
    0xFFC00000,
    0x7F800001,
    0x7F80FFFF,
    0x7FFFFFFF,
    0xFFFFFFFF,
)


def _float32_bits():
    """Random float32 bit patterns (every exponent alike) and `SPECIAL_BITS`."""
    random_bits = np.random.default_rng(0).integers(0, 2**32, 200_000, np.uint64)
    special = np.array(SPECIAL_BITS, np.uint64)
    return np.concatenate([random_bits, special]).astype(np.uint32)


def _bfloat16_value(bits):
    """float64 value of bfloat16 `bits` (as float32 patterns); infinity as 2**128.

    Rounding decides as if the exponent range went on: a value rounds to
    infinity when its nearest neighbour, so extended, is 2**128.
    """
    with np.errstate(invalid="ignore"):  # NaN patterns
        values = bits.view(np.float32).astype(np.float64)
    infinite = np.isinf(values)
    values[infinite] = np.copysign(2.0**128, values[infinite])
    return values


def _nearest_even_reference(values32):
    """Round float32 `values32` to bfloat16 by float64 distances, ties to even.

    Returns the results as float64 (infinities as infinities, NaN as NaN).
    """
    bits = values32.view(np.uint32)
    toward_zero = bits & np.uint32(0xFFFF0000)
    away = toward_zero + np.uint32(0x10000)  # the next magnitude, same sign
    with np.errstate(invalid="ignore"):
        exact = values32.astype(np.float64)
    low, high = _bfloat16_value(toward_zero), _bfloat16_value(away)
    low_distance, high_distance = np.abs(exact - low), np.abs(exact - high)
    low_is_even = ((toward_zero >> 16) & 1) == 0
    take_low = (low_distance < high_distance) | (
        (low_distance == high_distance) & low_is_even
    )
    rounded = np.where(take_low, low, high)
    rounded[np.abs(rounded) >= 2.0**128] *= np.inf
    rounded[np.isinf(exact)] = exact[np.isinf(exact)]
    rounded[np.isnan(exact)] = np.nan
    return rounded


@pytest.mark.parametrize("inside_xla", (False, True), ids=("ops", "jit"))
def test_rounding_to_bfloat16_is_to_nearest_even_for_every_float32(inside_xla):
    values32 = _float32_bits().view(np.float32)
    rounded = _rounding.rounded_to
    if inside_xla:
        rounded = tf.function(rounded, jit_compile=True)
    result = rounded(tf.constant(values32), tf.bfloat16)
    assert result.dtype == tf.bfloat16
    # NumPy widens: TensorFlow's kernels flush denormals to zero.
    actual = np.asarray(result).astype(np.float64)
    expected = _nearest_even_reference(values32)
    np.testing.assert_array_equal(np.isnan(actual), np.isnan(expected))
    finite_or_infinite = ~np.isnan(expected)
    np.testing.assert_array_equal(
        actual[finite_or_infinite], expected[finite_or_infinite]
    )
    # Signed zeros keep their sign.
    signs = np.signbit(actual[finite_or_infinite])
    np.testing.assert_array_equal(signs, np.signbit(expected[finite_or_infinite]))


@pytest.mark.parametrize("dtype", ("float16", "float32", "float64"))
def test_other_dtypes_are_cast(dtype):
    values = tf.constant([1.0 + 2.0**-12, -3.5e38, 7e-8, np.nan], tf.float32)
    result = _rounding.rounded_to(values, dtype)
    assert result.dtype == dtype
    np.testing.assert_array_equal(
        np.asarray(result), np.asarray(tf.cast(values, dtype))
    )

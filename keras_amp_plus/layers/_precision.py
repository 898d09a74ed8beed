"""The wide dtype the layers compute statistics and activations in."""

import functools

import tensorflow as tf

from keras_amp_plus import _hardware


def statistics_dtype(dtype) -> tf.DType:
    """Return the dtype to compute in for inputs of `dtype`: float32 or float64.

    Statistics (and Swish's arithmetic) run in float32 for every input
    precision below it, and in float64 for float64 inputs, so that a float64
    model keeps float64 results.

    Args:
        dtype: the input's dtype (a `tf.DType` or its name).

    Returns:
        `tf.float64` for float64 inputs, `tf.float32` otherwise.

    Example:
    >>> statistics_dtype("bfloat16").name, statistics_dtype("float64").name
    ('float32', 'float64')
    """
    return tf.float64 if tf.as_dtype(dtype) == tf.float64 else tf.float32


def broadcast_weights(gamma, beta, inputs, kept_axes):
    """Return `gamma` and `beta` shaped to broadcast against `inputs`.

    Both normalization layers keep per-feature (or per-channel) weights; the
    kernels take them with one axis per input axis, size 1 except along
    `kept_axes`, in `statistics_dtype(inputs.dtype)`. A missing weight
    (`scale=False` / `center=False`) becomes ones / zeros of that shape.

    Args:
        gamma: the scale variable, or None.
        beta: the offset variable, or None.
        inputs: the layer's input tensor (its static shape is used).
        kept_axes: non-negative ints, the axes the weights vary along.

    Returns:
        `(gamma, beta)` as tensors of the broadcast shape.

    Example:
    >>> import tensorflow as tf
    >>> gamma, beta = broadcast_weights(None, None, tf.zeros([2, 3, 4]), (2,))
    >>> gamma.shape.as_list(), float(tf.reduce_sum(gamma)), beta.dtype.name
    ([1, 1, 4], 4.0, 'float32')
    """
    dtype = statistics_dtype(inputs.dtype)
    shape = [1] * inputs.shape.rank
    for axis in kept_axes:
        shape[axis] = inputs.shape[axis]

    def reshaped(weight, fill):
        if weight is None:
            return tf.fill(shape, tf.constant(fill, dtype))
        return tf.reshape(tf.cast(weight, dtype), shape)

    return reshaped(gamma, 1.0), reshaped(beta, 0.0)


@functools.cache
def cpu_has_float16_arithmetic() -> bool | None:
    """Return whether this CPU has AVX512-FP16 or AMX-FP16 (None: unknown).

    Without them each float16 operation runs as a float32 one whose result is
    rounded back to float16: slower than the same arithmetic done in float32
    and rounded once at the end.

    Example:
    >>> cpu_has_float16_arithmetic() in (True, False, None)
    True
    """
    features = _hardware.cpu_facts()["features"]
    return _hardware.has_any(features, _hardware.FLOAT16_FLAGS)


def emulated_float16(dtype) -> bool:
    """Return True for float16 on a CPU known to lack float16 arithmetic.

    Example:
    >>> emulated_float16("bfloat16")
    False
    """
    return tf.as_dtype(dtype) == tf.float16 and cpu_has_float16_arithmetic() is False


def kernel_dtype(dtype) -> tf.DType:
    """Return the dtype a TensorFlow kernel had better compute `dtype` inputs in.

    float32 for float16 on a CPU known to lack float16 arithmetic
    (`emulated_float16`): there TensorFlow's float16 kernels widen and round
    each operation on their own, and widening the input once, running the
    float32 kernel and rounding its result once was faster. `dtype` itself
    otherwise.

    Example:
    >>> kernel_dtype("bfloat16").name
    'bfloat16'
    """
    return tf.float32 if emulated_float16(dtype) else tf.as_dtype(dtype)

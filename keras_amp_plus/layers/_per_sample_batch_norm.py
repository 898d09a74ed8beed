"""Instance normalization as TensorFlow's batch-norm kernel, one call per sample.

A channels-last sample `(1, S..., C)` normalized over S is exactly a batch
norm of that sample: statistics per channel over every other axis. So each
sample goes through `FusedBatchNormV3` in its own layout, where
`_batch_norm_formula` transposes the whole input, output and gradients to put
the (sample, channel) pairs last. Slices along the first axis are views of
the input (TensorFlow does not copy aligned first-axis slices), so a pass
costs the kernel's own work plus one copy into the joined result.

The price is two kernel calls per sample, a fixed cost per call that only
large samples amortize: `applies` holds from `MIN_SAMPLE_ELEMENTS` elements
per sample on. A batch size known when the step is traced (up to
`MAX_SAMPLES`) is unrolled into the graph; any other runs a `tf.while_loop`
over the samples, as `fit` traces a `tf.data` pipeline without
`drop_remainder`. Where it beats the other paths is measured
(`_path_calibration`).
"""

import math

import tensorflow as tf

from keras_amp_plus.layers import _batch_norm_formula, _saved_gradient

# Below this many elements per sample the two kernel calls per sample cost
# more than the transposes they save: on an AMD EPYC (Zen 5), oneDNN on and
# off, this layout ran 1.1-3.4x Keras's layer at 8-64k elements per sample
# and tied the transposed batch norm at 128k (`benchmarks/paths.py`).
MIN_SAMPLE_ELEMENTS = 2**17
# Each unrolled sample adds a few ops to the traced graph; larger batches
# run the loop.
MAX_SAMPLES = 256


def applies(x, gamma, epsilon, stat_axes) -> bool:
    """Return True when `x` can be normalized one sample at a time.

    That is where `_batch_norm_formula.applies`, with at least
    `MIN_SAMPLE_ELEMENTS` elements per sample, known at trace time.
    """
    if not _batch_norm_formula.applies(x, gamma, epsilon, stat_axes):
        return False
    sample_elements = x.shape[1:].num_elements()
    return sample_elements is not None and sample_elements >= MIN_SAMPLE_ELEMENTS


def per_sample_normalize(x, gamma, beta, epsilon, stat_axes, output_dtype):
    """Return the instance-normalized `x`; see `fused_normalize`.

    Args:
        x: a channels-last tensor with `applies(x, gamma, epsilon,
            stat_axes)` True.
        gamma: the per-channel scale, shape `(1, ..., 1, C)`, float32.
        beta: the per-channel offset, like `gamma`.
        epsilon: positive float added to the variance.
        stat_axes: the middle axes `(1, ..., rank - 2)`.
        output_dtype: the dtype of the result.

    Returns:
        The normalized, scaled and shifted `x` in `output_dtype`,
        differentiable w.r.t. `x`, `gamma` and `beta`.

    Example:
    >>> import tensorflow as tf
    >>> x = tf.constant([[[[1000.0]], [[1002.0]]]])  # (1, 2, 1, 1)
    >>> ones, zeros = tf.ones([1, 1, 1, 1]), tf.zeros([1, 1, 1, 1])
    >>> out = per_sample_normalize(x, ones, zeros, 1e-3, (1, 2), tf.float32)
    >>> [round(float(v), 2) for v in tf.reshape(out, [-1])]
    [-1.0, 1.0]
    """
    return _saved_gradient.normalize_with(
        per_sample_forward,
        per_sample_backward,
        x,
        gamma,
        beta,
        epsilon,
        stat_axes,
        output_dtype,
    )


def per_sample_forward(x, gamma, beta, epsilon, stat_axes, output_dtype):
    """Return `(outputs, saved)`: `per_sample_normalize` and what its gradient reads.

    `saved` is the kernel's three reserve spaces (float32), stacked over
    the samples, which `per_sample_backward` hands back to the gradient
    kernel sample by sample.
    """
    del stat_axes  # always the middle axes (`applies`)
    scale, offset = _per_channel(gamma), _per_channel(beta)
    shape = _sample_shape(x)

    def forward(sample):
        outputs, _, _, *saved = tf.raw_ops.FusedBatchNormV3(
            x=tf.reshape(sample, shape),
            scale=scale,
            offset=offset,
            mean=tf.constant([], tf.float32),
            variance=tf.constant([], tf.float32),
            epsilon=epsilon,
            exponential_avg_factor=1.0,
            data_format="NHWC",
            is_training=True,
        )
        return (outputs, *saved)

    outputs, *saved = _over_samples(forward, (x,), (x.dtype, *[tf.float32] * 3))
    # A loop's stacked results have no static rank; the reserve spaces are
    # vectors (the third one may be empty), so one row per sample.
    saved = tuple(tf.reshape(s, [tf.shape(x)[0], -1]) for s in saved)
    return tf.cast(tf.reshape(outputs, tf.shape(x)), output_dtype), saved


def per_sample_backward(upstream, x, gamma, saved, epsilon, stat_axes):
    """Return the gradients w.r.t. (x, gamma, beta) of `per_sample_forward`."""
    del stat_axes
    scale, shape = _per_channel(gamma), _sample_shape(x)

    def backward(upstream, sample, *reserve):
        x_grad, scale_grad, offset_grad, _, _ = tf.raw_ops.FusedBatchNormGradV3(
            y_backprop=tf.reshape(upstream, shape),
            x=tf.reshape(sample, shape),
            scale=scale,
            reserve_space_1=reserve[0],
            reserve_space_2=reserve[1],
            reserve_space_3=reserve[2],
            epsilon=epsilon,
            data_format="NHWC",
            is_training=True,
        )
        return x_grad, scale_grad, offset_grad

    x_grad, scale_grad, offset_grad = _over_samples(
        backward,
        (tf.cast(upstream, x.dtype), x, *saved),
        (x.dtype, tf.float32, tf.float32),
    )
    return (
        tf.reshape(x_grad, tf.shape(x)),
        tf.reshape(tf.reduce_sum(scale_grad, 0), tf.shape(gamma)),
        tf.reshape(tf.reduce_sum(offset_grad, 0), tf.shape(gamma)),
    )


def _over_samples(fn, tensors, dtypes):
    """Return `fn` of each sample of `tensors`, each result joined on axis 0.

    `fn` takes one first-axis slice of each tensor (without that axis) and
    returns tensors of `dtypes`; the results are stacked along a new first
    axis. Unrolled for a known batch size up to `MAX_SAMPLES`, else a loop.
    """
    samples = tensors[0].shape[0]
    if samples is not None and samples <= MAX_SAMPLES:
        results = [fn(*(t[i] for t in tensors)) for i in range(samples)]
        return [tf.stack(parts) for parts in zip(*results, strict=True)]
    count = tf.shape(tensors[0])[0]
    arrays = tuple(tf.TensorArray(dtype, size=count) for dtype in dtypes)

    def body(i, arrays):
        results = fn(*(t[i] for t in tensors))
        return i + 1, tuple(a.write(i, r) for a, r in zip(arrays, results, strict=True))

    _, arrays = tf.while_loop(lambda i, _: i < count, body, (0, arrays))
    return [array.stack() for array in arrays]


def _sample_shape(x):
    """Return one sample's shape as the kernel reads it: `(1, S, 1, C)`."""
    return [1, math.prod(x.shape[1:-1]), 1, x.shape[-1]]


def _per_channel(weight):
    """Return a `(1, ..., 1, C)` weight as the kernel's `(C,)` vector."""
    return tf.reshape(weight, [weight.shape[-1]])

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
`drop_remainder`. float16 samples on a CPU without float16 arithmetic run
the float32 kernel, each widened and rounded once
(`_precision.kernel_dtype`). Where it beats the other paths is measured
(`_path_calibration`).
"""

import tensorflow as tf

from keras_amp_plus.layers import _batch_norm_formula, _precision, _saved_gradient

# Below this many elements per sample the two kernel calls per sample cost
# more than the transposes they save: on an AMD EPYC Zen 4 this layout ran
# 2.7-3.6x Keras's layer at 8k elements per sample, 1.6-2.1x at 16k and
# 0.86-1.05x at 64k, never the fastest path (`benchmarks/paths.py`).
MIN_SAMPLE_ELEMENTS = 2**17
# Each unrolled sample adds a few ops to the traced graph; larger batches
# run the loop.
MAX_SAMPLES = 256


def applies(x, gamma, epsilon, stat_axes) -> bool:
    """Return True when `x` can be normalized one sample at a time.

    That is where `_batch_norm_formula.applies`, with at least
    `MIN_SAMPLE_ELEMENTS` elements per sample, known at trace time. Samples
    of a size unknown at trace time (any image size) may run it too: the
    run-time switch decides by their size
    (`_path_choice.paths_by_sample_size`).
    """
    if not _batch_norm_formula.applies(x, gamma, epsilon, stat_axes):
        return False
    sample_elements = x.shape[1:].num_elements()
    return sample_elements is not None and sample_elements >= MIN_SAMPLE_ELEMENTS


def per_sample_normalize(x, gamma, beta, epsilon, stat_axes, output_dtype):
    """Return the instance-normalized `x`; see `fused_normalize`.

    Args and result as `_batch_norm_formula.batch_norm_normalize`, for an `x`
    with `applies(x, gamma, epsilon, stat_axes)` True.

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

    `saved` is the kernel's three reserve spaces (float32): the statistics
    stacked over the samples, which `per_sample_backward` hands back to the
    gradient kernel sample by sample, and its workspace, alike for every
    sample (empty, or a placeholder its CPU gradient does not read).
    """
    del stat_axes  # always the middle axes (`applies`)
    scale, offset = _per_channel(gamma), _per_channel(beta)
    shape, channels = _sample_shape(x), [x.shape[-1]]
    kernel_dtype = _precision.kernel_dtype(x.dtype)
    output_dtype = tf.as_dtype(output_dtype)

    def forward(sample):
        outputs, _, _, mean, variance, workspace = tf.raw_ops.FusedBatchNormV3(
            x=_as_sample(sample, shape, kernel_dtype),
            scale=scale,
            offset=offset,
            mean=tf.constant([], tf.float32),
            variance=tf.constant([], tf.float32),
            epsilon=epsilon,
            exponential_avg_factor=1.0,
            data_format="NHWC",
            is_training=True,
        )
        return (tf.cast(outputs, output_dtype), mean, variance), (workspace,)

    specs = ((output_dtype, shape), (tf.float32, channels), (tf.float32, channels))
    (outputs, mean, variance), (workspace,) = _over_samples(
        forward, (x,), specs, kept=1
    )
    outputs = tf.reshape(outputs, tf.shape(x))
    return outputs, (mean, variance, workspace)


def per_sample_backward(upstream, x, gamma, saved, epsilon, stat_axes):
    """Return the gradients w.r.t. (x, gamma, beta) of `per_sample_forward`."""
    del stat_axes
    scale, shape, channels = _per_channel(gamma), _sample_shape(x), [x.shape[-1]]
    workspace, kernel_dtype = saved[2], _precision.kernel_dtype(x.dtype)

    def backward(upstream, sample, mean, variance):
        x_grad, scale_grad, offset_grad, _, _ = tf.raw_ops.FusedBatchNormGradV3(
            y_backprop=_as_sample(upstream, shape, kernel_dtype),
            x=_as_sample(sample, shape, kernel_dtype),
            scale=scale,
            reserve_space_1=mean,
            reserve_space_2=variance,
            reserve_space_3=workspace,
            epsilon=epsilon,
            data_format="NHWC",
            is_training=True,
        )
        return (tf.cast(x_grad, sample.dtype), scale_grad, offset_grad), ()

    specs = ((x.dtype, shape), (tf.float32, channels), (tf.float32, channels))
    (x_grad, scale_grad, offset_grad), _ = _over_samples(
        backward, (upstream, x, saved[0], saved[1]), specs
    )
    return (
        tf.reshape(x_grad, tf.shape(x)),
        tf.reshape(tf.reduce_sum(scale_grad, 0), tf.shape(gamma)),
        tf.reshape(tf.reduce_sum(offset_grad, 0), tf.shape(gamma)),
    )


def _over_samples(fn, tensors, specs, kept=0):
    """Return `fn` of each sample of `tensors`: results stacked, kept ones last.

    `fn` takes one first-axis slice of each tensor (without that axis) and
    returns `(results, kept values)`: tensors of the `(dtype, shape)` pairs in
    `specs`, stacked along a new first axis, and `kept` float32 tensors every
    sample gives alike, of which the last sample's are returned (empty
    vectors for an empty batch). Unrolled for a known batch size from 1 to
    `MAX_SAMPLES`, else a loop.
    """
    samples = tensors[0].shape[0]
    if samples is not None and 0 < samples <= MAX_SAMPLES:
        calls = [fn(*(t[i] for t in tensors)) for i in range(samples)]
        results = zip(*(results for results, _ in calls), strict=True)
        return [tf.stack(parts) for parts in results], calls[-1][1]
    count = tf.shape(tensors[0])[0]
    # Element shapes as known (`_stacked`): an empty batch stacks to no rows.
    arrays = tuple(
        tf.TensorArray(dtype, size=count, element_shape=shape) for dtype, shape in specs
    )
    last = tuple(tf.zeros([0]) for _ in range(kept))

    def body(i, arrays, last):
        results, last = fn(*(t[i] for t in tensors))
        arrays = tuple(a.write(i, r) for a, r in zip(arrays, results, strict=True))
        return i + 1, arrays, tuple(last)

    invariants = (
        tf.TensorShape([]),
        tuple(tf.TensorShape(None) for _ in arrays),
        tuple(tf.TensorShape(None) for _ in last),
    )
    _, arrays, last = tf.while_loop(
        lambda i, *_: i < count, body, (0, arrays, last), shape_invariants=invariants
    )
    return [_stacked(array, count) for array in arrays], last


def _stacked(array, count):
    """Return `array.stack()`, also for an empty array of a partly known shape.

    An element shape known at trace time stacks an empty array to an empty
    tensor; one with an unknown sample size (any image size) cannot, so an
    empty batch (a replica's share of a partial batch) gets zeros of no rows.
    """
    shape = array.element_shape
    if shape.is_fully_defined():
        return array.stack()
    empty = [0, *(size or 0 for size in shape)]
    return tf.cond(count > 0, array.stack, lambda: tf.zeros(empty, array.dtype))


def _sample_shape(x):
    """Return one sample's shape as the kernel reads it: `(1, S, 1, C)`.

    S is None where the sample's size is unknown at trace time (any image
    size): then it is read at run time (`_as_sample`).
    """
    return tf.TensorShape([1, x.shape[1:-1].num_elements(), 1, x.shape[-1]])


def _as_sample(tensor, shape, dtype):
    """Return one sample (or its gradient) reshaped to `_sample_shape`, in `dtype`."""
    return tf.cast(tf.reshape(tensor, [1, -1, 1, shape[-1]]), dtype)


def _per_channel(weight):
    """Return a `(1, ..., 1, C)` weight as the kernel's `(C,)` vector."""
    return tf.reshape(weight, [weight.shape[-1]])

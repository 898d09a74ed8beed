"""Normalization with float32 statistics as two XLA-fused kernels.

Shared by `LayerNormalization` and `InstanceNormalization`. Stock TensorFlow has
no fused layer-norm kernel; Keras's layers chain a dozen elementwise ops and
reductions, each a pass over memory. Here the forward and the backward pass are
each one `tf.function(jit_compile=True)`, which XLA fuses into a few loops, tied
together by a `tf.custom_gradient` that keeps only the input (in its own, low
precision dtype) and the per-row mean and inverse standard deviation for the
backward pass instead of a float32 copy of the normalized input.

Why XLA also fixes graph-level AMP: grappler's `auto_mixed_precision_onednn_bfloat16`
rewrite paints Keras's `Mean`/`SquaredDifference`/`Rsqrt` bfloat16, but it skips
functions that XLA must compile, so the statistics here stay float32.

Candidates measured on (8192, 1024) bfloat16, forward + backward, CPU time
relative to `keras.layers.LayerNormalization` (`python benchmarks/layers.py`
prints the table): FusedBatchNormV3 reshaping trick 0.70x (and less accurate:
its output is rounded before the float32 affine); float32 TF ops 0.82x; the
same with this custom gradient 0.67x; XLA with autodiff 0.43x; XLA with this
custom gradient and the sums as dots (below) 0.21x. The dots only pay from
about 4M elements on: below that XLA emits them as single-threaded loops
(0.94-1.27x of Keras's layer at 1.5M-3M elements), so there the sums stay
reductions (0.41-0.64x from 0.26M to 3M elements in the benchmark's row scan;
at (64, 1024) XLA's fixed cost per call of ~0.2 ms dominates: 0.9x). One-pass statistics
(E[x^2] - E[x]^2) were as fast and failed on N(1000, 1) inputs, so the mean is
subtracted before the variance is taken.
"""

import tensorflow as tf

from keras_amp_plus.layers import _row_buckets


def statistics_dtype(dtype: tf.DType) -> tf.DType:
    """Return the dtype statistics are computed in: float32, or float64 inputs'."""
    return tf.float64 if dtype == tf.float64 else tf.float32


# Below this many elements XLA's CPU backend emits a (rows, n) x (n, 1) dot as
# its own single-threaded loop, slower than the plain reduction: on
# (rows, 1024) bfloat16 layer norms, forward + backward, relative to Keras's
# layer, dots measured 0.94-1.27x at 1536-3000 rows and 0.25x at 4096 rows.
# With this switch `benchmarks/layers.py` (row scan) measured 0.41-0.64x from
# 256 to 3000 rows and 0.20-0.21x at 4096 and 8192 rows.
_DOT_SUM_MIN_ELEMENTS = 2**22


def _sum_over_axes(t, axes):
    """Sum `t` over `axes` (keepdims); a matrix product when they are adjacent.

    XLA's CPU backend emits reductions as plain loops, while a dot becomes one
    call into a multi-threaded, vectorized GEMM: summing a (32, 4096, 128)
    float32 tensor over its middle axis took 35 ms as a reduction and 5 ms as
    `ones(1, 4096) @ x`. Below `_DOT_SUM_MIN_ELEMENTS` the reduction is the
    faster one. The shapes are read at run time, so unknown (None) dimensions
    at trace time are fine.
    """
    axes = sorted(axes)
    if axes != list(range(axes[0], axes[-1] + 1)):
        return tf.reduce_sum(t, axis=axes, keepdims=True)
    dims = tf.shape(t)
    summed = tf.reduce_prod(dims[axes[0] : axes[-1] + 1])
    ones = tf.ones(tf.stack([1, summed]), t.dtype)
    if axes[-1] == t.shape.rank - 1:  # trailing axes: rows times a ones column
        blocks = tf.reshape(t, tf.stack([-1, summed]))

        def as_dot():
            return tf.linalg.matmul(blocks, ones, transpose_b=True)

    else:  # a middle block: a ones row times each (summed, trailing) matrix
        trailing = tf.reduce_prod(dims[axes[-1] + 1 :])
        blocks = tf.reshape(t, tf.stack([-1, summed, trailing]))

        def as_dot():
            return tf.linalg.matmul(ones, blocks)

    # The size is a constant to XLA, which keeps only the branch taken.
    sums = tf.cond(
        tf.size(blocks) >= _DOT_SUM_MIN_ELEMENTS,
        as_dot,
        lambda: tf.reduce_sum(blocks, axis=1, keepdims=True),
    )
    # Built from slices of the shape (not a scatter) so that XLA can still
    # evaluate it at compile time when this runs inside a jit-compiled model.
    kept = tf.concat(
        [dims[: axes[0]], tf.ones([len(axes)], dims.dtype), dims[axes[-1] + 1 :]],
        axis=0,
    )
    return tf.reshape(sums, kept)


def _count(t, axes):
    """Return the number of elements of `t` along `axes`, read at run time."""
    return tf.reduce_prod(tf.gather(tf.shape(t), list(axes)))


def _mean_over_axes(t, axes):
    return _sum_over_axes(t, axes) / tf.cast(_count(t, axes), t.dtype)


@tf.function(jit_compile=True)
def _normalize_forward(x, gamma, beta, epsilon, stat_axes, output_dtype):
    """Return (outputs, mean, inverse_stddev); statistics in float32 or wider."""
    x_wide = tf.cast(x, gamma.dtype)
    mean = _mean_over_axes(x_wide, stat_axes)
    centered = x_wide - mean
    variance = _mean_over_axes(tf.square(centered), stat_axes)
    inverse_stddev = tf.math.rsqrt(variance + epsilon)
    outputs = centered * (inverse_stddev * gamma) + beta
    return tf.cast(outputs, output_dtype), mean, inverse_stddev


@tf.function(jit_compile=True)
def _normalize_backward(
    upstream, x, mean, inverse_stddev, gamma, stat_axes, param_reduce_axes
):
    """Return the gradients w.r.t. (x, gamma, beta) of `_normalize_forward`."""
    upstream_wide = tf.cast(upstream, gamma.dtype)
    # Recomputing the normalized input from x costs one fused multiply-add per
    # element and saves keeping a float32 copy of it alive between the passes.
    normalized = (tf.cast(x, gamma.dtype) - mean) * inverse_stddev
    upstream_normalized = upstream_wide * normalized
    if set(stat_axes) <= set(param_reduce_axes):
        # gamma is constant over the statistics' axes (instance norm): it
        # factors out, and the per-sample sums also give the weight gradients.
        upstream_mean = _mean_over_axes(upstream_wide, stat_axes)
        projection = _mean_over_axes(upstream_normalized, stat_axes)
        x_grad = (inverse_stddev * gamma) * (
            upstream_wide - upstream_mean - normalized * projection
        )
        count = tf.cast(_count(x, stat_axes), gamma.dtype)
        remaining = sorted(set(param_reduce_axes) - set(stat_axes))
        gamma_grad = tf.reduce_sum(projection * count, remaining, keepdims=True)
        beta_grad = tf.reduce_sum(upstream_mean * count, remaining, keepdims=True)
    else:
        scaled = upstream_wide * gamma
        scaled_mean = _mean_over_axes(scaled, stat_axes)
        projection = _mean_over_axes(scaled * normalized, stat_axes)
        x_grad = inverse_stddev * (scaled - scaled_mean - normalized * projection)
        gamma_grad = _sum_over_axes(upstream_normalized, param_reduce_axes)
        beta_grad = _sum_over_axes(upstream_wide, param_reduce_axes)
    return tf.cast(x_grad, x.dtype), gamma_grad, beta_grad


def fused_normalize(x, gamma, beta, epsilon, stat_axes, output_dtype):
    """Normalize `x` over `stat_axes` with float32 statistics, then scale/shift.

    Args:
        x: a float tensor of any float dtype.
        gamma: the scale, already reshaped to broadcast against `x`, in
            `statistics_dtype(x.dtype)`.
        beta: the offset, same shape and dtype as `gamma`.
        epsilon: a positive Python float added to the variance.
        stat_axes: tuple of non-negative ints, the axes statistics are taken over.
        output_dtype: the dtype of the result (the layer's compute dtype).

    Returns:
        `(x - mean) * rsqrt(variance + epsilon) * gamma + beta` in
        `output_dtype`, differentiable w.r.t. `x`, `gamma` and `beta`.
    """
    stat_axes = tuple(stat_axes)
    output_dtype = tf.as_dtype(output_dtype)

    def normalize(x, gamma, beta, stat_axes):
        return _normalize_with_gradient(
            x, gamma, beta, epsilon, stat_axes, output_dtype
        )

    # Variable-length inputs would compile new XLA kernels at every new shape.
    if _row_buckets.applies(x, gamma, stat_axes):
        return _row_buckets.normalize_in_row_buckets(
            normalize, x, gamma, beta, stat_axes
        )
    return normalize(x, gamma, beta, stat_axes)


def _normalize_with_gradient(x, gamma, beta, epsilon, stat_axes, output_dtype):
    """`fused_normalize` on shapes as they come, one XLA kernel per shape."""
    param_reduce_axes = tuple(
        axis for axis in range(x.shape.rank) if gamma.shape[axis] == 1
    )

    @tf.custom_gradient
    def normalize(x, gamma, beta):
        outputs, mean, inverse_stddev = _normalize_forward(
            x, gamma, beta, epsilon, stat_axes, output_dtype
        )

        def grad(upstream):
            return _normalize_backward(
                upstream, x, mean, inverse_stddev, gamma, stat_axes, param_reduce_axes
            )

        return outputs, grad

    return normalize(x, gamma, beta)

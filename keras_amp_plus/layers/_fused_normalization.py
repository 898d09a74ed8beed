"""Normalization with float32 statistics as two XLA-fused kernels.

Shared by `LayerNormalization` and `InstanceNormalization`. Stock TensorFlow has
no fused layer-norm kernel; Keras's layers chain a dozen elementwise ops and
reductions, each a pass over memory. Here the forward and the backward pass are
each one `tf.function(jit_compile=True)`, which XLA fuses into a few loops, tied
together by a `tf.custom_gradient` that keeps only the input (in its own, low
precision dtype) and three numbers per row (a shift, the mean and the inverse
standard deviation) for the backward pass instead of a float32 copy of the
normalized input.

Why XLA also fixes graph-level AMP: grappler's `auto_mixed_precision_onednn_bfloat16`
rewrite paints Keras's `Mean`/`SquaredDifference`/`Rsqrt` bfloat16, but it skips
functions that XLA must compile, so the statistics here stay float32.

Sums over trailing axes (a row's statistics) are matrix products with a ones
column, and sums over middle axes (instance norm channels last) batched
products with a ones row, which XLA runs as calls into a vectorized GEMM
instead of the scalar loops it emits for reductions fused with their
operands (see `_sum_over_axes`); the weights' gradients are reductions.
One-pass statistics (E[x^2] - E[x]^2) fail on N(1000, 1) inputs, so the mean is
subtracted before the variance is taken, and both are taken of the input minus
each row's first element (see `_normalize_forward`). Where these kernels do not beat
Keras's layers, `fused_normalize` runs Keras's formula or, for instance norm,
TensorFlow's batch-norm kernel instead (`_path_choice` decides;
`benchmarks/layers.py` measures them).
"""

import tensorflow as tf

from keras_amp_plus import _compat
from keras_amp_plus.layers import (
    _batch_norm_formula,
    _feature_rows,
    _keras_formula,
    _path_choice,
    _per_sample_batch_norm,
    _precision,
    _row_buckets,
    _size_switch,
)


def _sum_over_axes(t, axes):
    """Sum `t` over `axes` (keepdims); a matrix product when they are adjacent.

    XLA's CPU backend emits a reduction fused with the elementwise ops that
    feed it as a scalar loop per output element, while a dot becomes a call
    into a vectorized GEMM (its operand written once): sums over trailing
    axes are a product with a ones column, sums over middle axes one with a
    ones row per leading index (instance norm channels last,
    `_product_means`); both faster than the reductions at the layer grid's
    shapes (benchmarks/README.md).
    Sums over leading axes (the weights' gradients) stay reductions. The
    shapes are read at run time, so unknown (None) dimensions at trace time
    are fine.
    """
    axes = sorted(axes)
    adjacent = axes == list(range(axes[0], axes[-1] + 1))
    trailing = axes[-1] == t.shape.rank - 1
    if not adjacent or (axes[0] == 0 and not trailing):
        # Leading axes (the weight gradients' sums): a column reduction,
        # which XLA vectorizes, beat the product at every size measured.
        return tf.reduce_sum(t, axis=axes, keepdims=True)
    dims = tf.shape(t)
    summed = tf.reduce_prod(dims[axes[0] : axes[-1] + 1])
    if trailing:  # rows times a ones column
        blocks = tf.reshape(t, tf.stack([-1, summed]))
        # A (summed, 1) column, not a transposed (1, summed) row: XLA emitted
        # the transposed product as a loop 3-8x slower at some shapes.
        sums = tf.linalg.matmul(blocks, tf.ones(tf.stack([summed, 1]), t.dtype))
    else:  # a middle block: a ones row times each (summed, inner) matrix
        inner = tf.reduce_prod(dims[axes[-1] + 1 :])
        blocks = tf.reshape(t, tf.stack([-1, summed, inner]))
        # One ones row per block, not one row broadcast over the blocks: XLA
        # compiled the broadcast product to a loop about 3x slower.
        ones = tf.ones(tf.stack([tf.shape(blocks)[0], 1, summed]), t.dtype)
        sums = tf.linalg.matmul(ones, blocks)
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
    sums = _sum_over_axes(t, axes)
    return sums / tf.cast(_count(t, axes), t.dtype)


def _first_along(t, axes):
    """Return the first element of `t` along each of `axes` (keepdims)."""
    size = [1 if axis in axes else -1 for axis in range(t.shape.rank)]
    return tf.slice(t, [0] * t.shape.rank, size)


@tf.function(jit_compile=True)
def _normalize_forward(x, gamma, beta, epsilon, stat_axes, output_dtype):
    """Return (outputs, statistics), statistics in float32 or wider.

    `statistics` is `(shift, shifted_mean, inverse_stddev)`, taken of
    `x - shift`, `shift` being each row's first element: its sums then stay
    near the spread of the row, not its offset, so the mean of inputs far
    from zero is exact to the rounding of their spread (a constant row of
    1000s centers to exact zeros, which a mean off by one float32 rounding,
    times `1 / sqrt(epsilon)`, would not).
    """
    x_wide = tf.cast(x, gamma.dtype)
    shift = _first_along(x_wide, stat_axes)
    shifted = x_wide - shift
    shifted_mean = _mean_over_axes(shifted, stat_axes)
    centered = shifted - shifted_mean
    variance = _mean_over_axes(tf.square(centered), stat_axes)
    inverse_stddev = tf.math.rsqrt(variance + epsilon)
    outputs = centered * (inverse_stddev * gamma) + beta
    statistics = (shift, shifted_mean, inverse_stddev)
    return tf.cast(outputs, output_dtype), statistics


@tf.function(jit_compile=True)
def _normalize_backward(
    upstream,
    x,
    statistics,
    gamma,
    stat_axes,
    param_reduce_axes,
):
    """Return the gradients w.r.t. (x, gamma, beta) of `_normalize_forward`."""
    shift, shifted_mean, inverse_stddev = statistics
    upstream_wide = tf.cast(upstream, gamma.dtype)
    # Recomputing the normalized input from x costs one fused multiply-add per
    # element and saves keeping a float32 copy of it alive between the passes.
    normalized = (tf.cast(x, gamma.dtype) - shift - shifted_mean) * inverse_stddev
    upstream_normalized = upstream_wide * normalized
    if set(stat_axes) <= set(param_reduce_axes):
        # gamma is constant over the statistics' axes (instance norm): it
        # factors out, and the per-sample sums also give the weight gradients.
        # They are summed from the sums themselves: written as means times
        # the count, XLA folded the division and the product away and summed
        # the full-size tensors a second time, over every axis at once.
        upstream_sum = _sum_over_axes(upstream_wide, stat_axes)
        projection_sum = _sum_over_axes(upstream_normalized, stat_axes)
        inverse_count = 1.0 / tf.cast(_count(x, stat_axes), gamma.dtype)
        x_grad = (inverse_stddev * gamma) * (
            upstream_wide
            - upstream_sum * inverse_count
            - normalized * (projection_sum * inverse_count)
        )
        remaining = sorted(set(param_reduce_axes) - set(stat_axes))
        gamma_grad = tf.reduce_sum(projection_sum, remaining, keepdims=True)
        beta_grad = tf.reduce_sum(upstream_sum, remaining, keepdims=True)
    else:
        scaled = upstream_wide * gamma
        scaled_mean = _mean_over_axes(scaled, stat_axes)
        projection = _mean_over_axes(scaled * normalized, stat_axes)
        x_grad = inverse_stddev * (scaled - scaled_mean - normalized * projection)
        # Both weight gradients in one reduction: inside a model XLA compiles
        # whole, XLA folds the rows reshape of a (batch, sequence, features)
        # upstream gradient into a lone reduction of it, then over two axes,
        # several times slower than over the rows; stacked, it cannot.
        both = tf.stack([upstream_normalized, upstream_wide])
        axes = [axis + 1 for axis in param_reduce_axes]
        gamma_grad, beta_grad = tf.unstack(tf.reduce_sum(both, axes, keepdims=True))
    return tf.cast(x_grad, x.dtype), gamma_grad, beta_grad


def fused_normalize(x, gamma, beta, epsilon, stat_axes, output_dtype):
    """Normalize `x` over `stat_axes` with float32 statistics, then scale/shift.

    Args:
        x: a float tensor of any float dtype.
        gamma: the scale, already reshaped to broadcast against `x`, in
            `_precision.statistics_dtype(x.dtype)`.
        beta: the offset, same shape and dtype as `gamma`.
        epsilon: a positive Python float added to the variance.
        stat_axes: tuple of non-negative ints, the axes statistics are taken over.
        output_dtype: the dtype of the result (the layer's compute dtype).

    Returns:
        `(x - mean) * rsqrt(variance + epsilon) * gamma + beta` in
        `output_dtype`, differentiable w.r.t. `x`, `gamma` and `beta`.

    Example:
    >>> import tensorflow as tf
    >>> x = tf.constant([[1000.0, 1001.0, 1002.0]])
    >>> ones, zeros = tf.ones([1, 3]), tf.zeros([1, 3])
    >>> out = fused_normalize(x, ones, zeros, 1e-3, (1,), tf.float32)
    >>> [round(float(v), 2) for v in out[0]]
    [-1.22, 0.0, 1.22]
    """
    stat_axes = tuple(stat_axes)
    output_dtype = tf.as_dtype(output_dtype)
    # Layer norm of (batch, sequence, features) as (rows, features): faster
    # on every path measured. Inputs whose length varies keep their shape
    # here; the kernels pad their rows to buckets (`kernels_normalize`).
    if _feature_rows.applies(x, gamma, stat_axes) and not _row_buckets.shapes_vary(x):

        def normalize_rows(rows, gamma, beta, stat_axes):
            return fused_normalize(rows, gamma, beta, epsilon, stat_axes, output_dtype)

        return _feature_rows.normalize_as_rows(
            normalize_rows, x, gamma, beta, stat_axes
        )

    if tf.executing_eagerly() and not _path_choice.path_is_forced():
        # Eager calls (a notebook's `model(image)`, a decoding loop) may bring
        # a new shape each time, and XLA compiles a kernel per shape, which
        # costs hundreds of calls: plain ops, as Keras's layers run.
        return _keras_formula.normalize_centered(
            x, gamma, beta, epsilon, stat_axes, output_dtype
        )
    trailing = _over_trailing_axes(x, stat_axes)
    batch_norm_applies = _batch_norm_formula.applies(x, gamma, epsilon, stat_axes)
    if batch_norm_applies and x.shape[1:].num_elements() is None:
        # Instance norm of any image size: the path by sample size and size.
        paths = _path_choice.paths_by_sample_size(x.dtype, batch_norm_applies)
        every_path = {path for _, runs in paths for _, path in runs}
        switch = _size_switch.switch_on_sample_size
    else:
        per_sample_applies = _per_sample_batch_norm.applies(
            x, gamma, epsilon, stat_axes
        )
        paths = _path_choice.paths_by_batch_size(
            x.shape, trailing, x.dtype, batch_norm_applies, per_sample_applies
        )
        every_path = {path for _, path in paths}
        switch = _size_switch.switch_on_batch_size
    if len(every_path) == 1:
        normalize = _NORMALIZE_BY_PATH[every_path.pop()]
        return normalize(x, gamma, beta, epsilon, stat_axes, output_dtype)

    def forward(path, x, gamma, beta):
        run = _FORWARD_BY_PATH[path]
        return run(x, gamma, beta, epsilon, stat_axes, output_dtype)

    def backward(path, upstream, x, gamma, saved):
        run = _BACKWARD_BY_PATH[path]
        return run(upstream, x, gamma, saved, epsilon, stat_axes)

    def reference(x, gamma, beta):
        # Plain ops, differentiated twice by autodiff (second-order gradients).
        return _keras_formula.normalize_by_reductions(
            x, gamma, beta, epsilon, stat_axes, output_dtype
        )

    return switch(x, gamma, beta, paths, forward, backward, reference)


def kernels_normalize(x, gamma, beta, epsilon, stat_axes, output_dtype):
    """`fused_normalize` by the fused kernels (the path `_path_calibration` races).

    Layer norm's leading axes flattened into rows (`_feature_rows`), padded
    to row buckets where their length varies (`_row_buckets`); anything
    else, instance norm channels last included, as it comes.
    """
    stat_axes = tuple(stat_axes)
    output_dtype = tf.as_dtype(output_dtype)

    def normalize(x, gamma, beta, stat_axes):
        return _normalize_with_gradient(
            x, gamma, beta, epsilon, stat_axes, output_dtype
        )

    # Variable-length inputs would compile new XLA kernels at every new shape.
    if _row_buckets.applies(x, gamma, stat_axes):
        normalize = _row_buckets.in_padded_rows(normalize)
    # Layer norm: the kernels' weight-gradient sums are fastest over one axis.
    if _feature_rows.applies(x, gamma, stat_axes):
        return _feature_rows.normalize_as_rows(normalize, x, gamma, beta, stat_axes)
    return normalize(x, gamma, beta, stat_axes)


def _normalize_with_gradient(x, gamma, beta, epsilon, stat_axes, output_dtype):
    """`fused_normalize` on shapes as they come, one XLA kernel per shape."""

    @tf.custom_gradient
    def normalize(x, gamma, beta):
        outputs, statistics = kernels_forward(
            x, gamma, beta, epsilon, stat_axes, output_dtype
        )

        def grad(upstream):
            return _kernels_backward(upstream, x, gamma, statistics, stat_axes)

        return outputs, grad

    return normalize(x, gamma, beta)


def kernels_forward(x, gamma, beta, epsilon, stat_axes, output_dtype):
    """Return `(outputs, saved)`: `kernels_normalize` and its statistics.

    For inputs behind the run-time switch (`_size_switch`), as they come.
    `saved` is `_normalize_forward`'s statistics.
    """
    output_dtype = tf.as_dtype(output_dtype)
    stat_axes = tuple(stat_axes)
    x = _kernels_input(x, stat_axes)
    return _normalize_forward(x, gamma, beta, epsilon, stat_axes, output_dtype)


def kernels_backward(upstream, x, gamma, saved, epsilon, stat_axes):
    """Return the gradients w.r.t. (x, gamma, beta) of `kernels_forward`."""
    del epsilon
    return _kernels_backward(upstream, x, gamma, saved, tuple(stat_axes))


def _kernels_backward(upstream, x, gamma, statistics, stat_axes):
    """`_normalize_backward` of the input as kept: widened again where it was.

    The input is kept in its own dtype and widened afresh (one more pass),
    not kept widened: no float32 copy of it lives between the passes.
    """
    x_grad, gamma_grad, beta_grad = _normalize_backward(
        upstream,
        _kernels_input(x, stat_axes),
        statistics,
        gamma,
        stat_axes,
        _param_reduce_axes(x, gamma),
    )
    return tf.cast(x_grad, x.dtype), gamma_grad, beta_grad


def _over_trailing_axes(x, stat_axes) -> bool:
    """Return True when `stat_axes` are `x`'s last axes (layer norm)."""
    rank = x.shape.rank
    return tuple(stat_axes) == tuple(range(rank - len(stat_axes), rank))


def _kernels_input(x, stat_axes):
    """Return `x` as the kernels read it: float16 instance norms widened outside XLA.

    On a CPU without float16 arithmetic (`_precision.emulated_float16`),
    XLA's kernels convert float16 values one by one; TensorFlow's `Cast`
    widens the whole input faster, and the kernels then run their float32
    program (the result is still rounded once, to the output dtype). Inside
    a model XLA compiles whole the cast would be XLA's own, and layer norm's
    float16 kernels measured as fast as its bfloat16 ones: both as they come.
    """
    widen = (
        _precision.emulated_float16(x.dtype)
        and not _over_trailing_axes(x, stat_axes)
        and not _compat.in_xla_compiled_function()
    )
    return tf.cast(x, tf.float32) if widen else x


def _param_reduce_axes(x, gamma):
    """Return the axes `gamma` is constant along (its gradient's sums)."""
    return tuple(axis for axis in range(x.shape.rank) if gamma.shape[axis] == 1)


_NORMALIZE_BY_PATH = {
    _path_choice.BATCH_NORM: _batch_norm_formula.batch_norm_normalize,
    _path_choice.KERAS_FORMULA: _keras_formula.keras_formula_normalize,
    _path_choice.FUSED_KERNELS: kernels_normalize,
    _path_choice.PER_SAMPLE_BATCH_NORM: _per_sample_batch_norm.per_sample_normalize,
}
_FORWARD_BY_PATH = {
    _path_choice.BATCH_NORM: _batch_norm_formula.batch_norm_forward,
    _path_choice.KERAS_FORMULA: _keras_formula.formula_forward,
    _path_choice.FUSED_KERNELS: kernels_forward,
    _path_choice.PER_SAMPLE_BATCH_NORM: _per_sample_batch_norm.per_sample_forward,
}
_BACKWARD_BY_PATH = {
    _path_choice.BATCH_NORM: _batch_norm_formula.batch_norm_backward,
    _path_choice.KERAS_FORMULA: _keras_formula.formula_backward,
    _path_choice.FUSED_KERNELS: kernels_backward,
    _path_choice.PER_SAMPLE_BATCH_NORM: _per_sample_batch_norm.per_sample_backward,
}

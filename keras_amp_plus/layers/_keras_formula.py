"""Keras's normalization formula, with the statistics kept in float32.

Where the fused kernels do not beat Keras's layers (see `_path_choice`), the
layers run Keras's own formula, `x * inv + (beta - mean * inv)` with `inv =
rsqrt(variance + epsilon) * gamma` (a mean, a variance that carries its own
gradient (`_variance_about`), elementwise ops).
Its gradient is the analytic one (`formula_backward`), fewer passes over
memory than TensorFlow's autodiff of the formula, except inside an
XLA-compiled model for layouts other than instance norm channels last: there
XLA fuses autodiff of the formula with its neighbours, and the form
matters: the mathematically equal `(x - mean) * inv + beta` keeps one more
full-size tensor for autodiff and ran slower.
Inside XLA, instance norm channels last takes its means as batched matrix
products (`_product_means`), which XLA's CPU backend runs several times
faster than the reductions it fuses (Keras's own program sums that way),
except where `_xla_sums_calibration` measured them slower on this machine.
Unlike Keras's layers, the statistics are computed in the dtype of `gamma`
(float32 or float64) whatever the input dtype. As in Keras's layers, `x *
inv` and `mean * inv` cancel for inputs far from zero: relative to the
output, about `|mean| / stddev` float32 roundings, below one bfloat16 or
float16 rounding unless the mean exceeds the standard deviation ~1000-fold.
"""

import functools

import tensorflow as tf

from keras_amp_plus import _compat
from keras_amp_plus.layers import (
    _product_means,
    _saved_gradient,
    _xla_sums_calibration,
)


def keras_formula_normalize(x, gamma, beta, epsilon, stat_axes, output_dtype):
    """Return the normalized `x` in `output_dtype`; see `fused_normalize`.

    Args:
        x: a float tensor.
        gamma: the scale, broadcastable against `x`, float32 or float64.
        beta: the offset, like `gamma`.
        epsilon: positive float added to the variance.
        stat_axes: the axes the statistics are taken over.
        output_dtype: the dtype of the result.

    Example:
    >>> import tensorflow as tf
    >>> x = tf.constant([[1000.0, 1001.0, 1002.0]])
    >>> ones, zeros = tf.ones([1, 3]), tf.zeros([1, 3])
    >>> out = keras_formula_normalize(x, ones, zeros, 1e-3, (1,), tf.float32)
    >>> [round(float(v), 2) for v in out[0]]
    [-1.22, 0.0, 1.22]
    """
    if _compat.in_xla_compiled_function():
        arguments = (x, gamma, beta, epsilon, stat_axes, output_dtype)
        if not _product_means.applies(x, stat_axes):
            return normalize_by_reductions(*arguments)
        elements = x.shape.num_elements()
        if elements is None and _xla_sums_calibration.measured_in(x.dtype):
            return normalize_by_size(*arguments)
        if _xla_sums_calibration.products_win(x.dtype, elements):
            return normalize_by_products(*arguments)
        return normalize_by_reductions(*arguments)
    # The analytic backward makes fewer passes over memory than TensorFlow's
    # autodiff of the formula, and took less CPU time at instance-norm shapes
    # in graph steps (`benchmarks/batch_switch.py`).
    return _saved_gradient.normalize_with(
        formula_forward,
        formula_backward,
        x,
        gamma,
        beta,
        epsilon,
        stat_axes,
        output_dtype,
    )


def normalize_by_reductions(x, gamma, beta, epsilon, stat_axes, output_dtype):
    """Return the formula with reductions, differentiated by autodiff.

    Inside XLA this is what XLA fuses with its neighbours, as it does Keras's
    own layers; the arguments are `keras_formula_normalize`'s.
    """
    outputs, _ = formula_forward(x, gamma, beta, epsilon, stat_axes, output_dtype)
    return outputs


def normalize_centered(x, gamma, beta, epsilon, stat_axes, output_dtype):
    """Return `(x - mean) * rsqrt(variance + epsilon) * gamma + beta`: plain ops.

    For eager calls, which may bring a new shape each and compile nothing:
    passes over `x` in `gamma`'s dtype, centred on the mean and then on the
    mean of the centred values (the first mean's rounding, about an ulp of
    the mean, would otherwise shift every output by that over the standard
    deviation), and the variance of the centred values, so inputs far from
    zero lose nothing to the cancellation of Keras's form; differentiated by
    autodiff. The arguments are `keras_formula_normalize`'s.

    Example:
    >>> import tensorflow as tf
    >>> x = tf.constant([[1000.0, 1001.0, 1002.0]])
    >>> ones, zeros = tf.ones([1, 3]), tf.zeros([1, 3])
    >>> out = normalize_centered(x, ones, zeros, 1e-3, (1,), tf.float32)
    >>> [round(float(v), 2) for v in out[0]]
    [-1.22, 0.0, 1.22]
    """
    x_wide = tf.cast(x, gamma.dtype)
    centered = x_wide - tf.reduce_mean(x_wide, stat_axes, keepdims=True)
    centered -= tf.reduce_mean(centered, stat_axes, keepdims=True)
    variance = tf.reduce_mean(tf.square(centered), stat_axes, keepdims=True)
    inv = tf.math.rsqrt(variance + epsilon) * gamma
    return tf.cast(centered * inv + beta, output_dtype)


def normalize_by_products(x, gamma, beta, epsilon, stat_axes, output_dtype):
    """Return the formula with means as batched products, analytic gradient.

    For instance norm channels last inside XLA (`_product_means.applies`);
    the analytic backward took less CPU time there than autodiff of the
    products (`benchmarks/in_xla_sums.py`). The arguments are
    `keras_formula_normalize`'s.
    """
    return _saved_gradient.normalize_with(
        _FORWARD_BY_PRODUCTS,
        _BACKWARD_BY_PRODUCTS,
        x,
        gamma,
        beta,
        epsilon,
        stat_axes,
        output_dtype,
    )


def _reduced_mean(t, stat_axes):
    """Return the mean of `t` over `stat_axes` (kept), by a reduction."""
    return tf.reduce_mean(t, list(stat_axes), keepdims=True)


def formula_forward(
    x, gamma, beta, epsilon, stat_axes, output_dtype, mean_of=_reduced_mean
):
    """Return `(outputs, saved)`: the formula and what `formula_backward` reads.

    `saved` is `(mean, inverse_stddev, empty)` in the dtype of `gamma`: three
    tensors like the other paths' (`_size_switch`). `mean_of(t, stat_axes)`
    takes the means (kept axes): a reduction, or `_product_means.middle_mean`.
    """
    x_wide = tf.cast(x, gamma.dtype)
    mean = mean_of(x_wide, stat_axes)
    variance = _variance_about(x_wide, mean, stat_axes, mean_of)
    inverse_stddev = tf.math.rsqrt(variance + epsilon)
    inverse = inverse_stddev * gamma
    outputs = tf.cast(x_wide * inverse + (beta - mean * inverse), output_dtype)
    return outputs, (mean, inverse_stddev, tf.zeros([0], gamma.dtype))


def _variance_about(x, mean, axes, mean_of):
    """Return the mean of `(x - mean)**2` over `axes`, differentiable twice.

    `tf.nn.moments` stops the mean's gradient inside the variance. The
    first-order gradient loses nothing by it (the variance's derivative along
    the mean, `-2 * mean(x - mean)`, is zero for every x), but autodiff of
    that gradient meets the stop again and drops the mean's share of the
    second-order one (a gradient penalty through a model XLA compiles, where
    autodiff of this formula is the layer's gradient). Here the gradient
    along `mean` is that zero, while the one along `x`, `2 * (x - mean) / n`,
    keeps `mean` differentiable: as cheap as the stop (XLA drops the zero),
    exact at every order.
    """

    @tf.custom_gradient
    def variance(x, mean):
        centered = x - mean
        # An empty batch has no means either: its count is left at 1.
        means = tf.maximum(tf.size(mean, tf.int64), 1)
        count = tf.cast(tf.size(x, tf.int64) // means, x.dtype)

        def grad(upstream):
            return upstream * (2.0 / count) * centered, tf.zeros_like(mean)

        return mean_of(tf.square(centered), axes), grad

    return variance(x, mean)


def formula_backward(
    upstream, x, gamma, saved, epsilon, stat_axes, mean_of=_reduced_mean
):
    """Return the gradients w.r.t. (x, gamma, beta) of `formula_forward`.

    The analytic gradient of a normalization (what autodiff of the formula
    computes, in fewer passes): with `n` the normalized input and `g` the
    upstream gradient times `gamma`, `inverse_stddev * (g - mean(g) - n *
    mean(g * n))`; the weights' gradients are sums over the axes they are
    constant along.
    """
    del epsilon
    mean, inverse_stddev, _ = saved
    upstream_wide = tf.cast(upstream, gamma.dtype)
    x_wide = tf.cast(x, gamma.dtype)
    stat_axes = list(stat_axes)
    weight_axes = [axis for axis in range(x.shape.rank) if gamma.shape[axis] == 1]
    if set(stat_axes) <= set(weight_axes):
        # gamma is constant over the statistics' axes (instance norm): the
        # per-sample means also give the weights' gradients, one pass fewer.
        # Neither `x - mean` nor the normalized input is formed: their
        # per-sample factors fold into small coefficients of `x`, which
        # cancel for inputs far from zero as the forward's do.
        upstream_mean = mean_of(upstream_wide, stat_axes)
        projection = inverse_stddev * (
            mean_of(upstream_wide * x_wide, stat_axes) - mean * upstream_mean
        )
        scale = inverse_stddev * gamma
        coefficient = scale * inverse_stddev * projection
        x_grad = scale * upstream_wide - (
            x_wide * coefficient + (scale * upstream_mean - mean * coefficient)
        )
        dims = tf.shape(x, out_type=tf.int64)
        count = tf.cast(tf.reduce_prod(tf.gather(dims, stat_axes)), gamma.dtype)
        remaining = sorted(set(weight_axes) - set(stat_axes))
        gamma_grad = tf.reduce_sum(projection * count, remaining, keepdims=True)
        beta_grad = tf.reduce_sum(upstream_mean * count, remaining, keepdims=True)
        return tf.cast(x_grad, x.dtype), gamma_grad, beta_grad
    normalized = (x_wide - mean) * inverse_stddev
    gamma_grad = tf.reduce_sum(upstream_wide * normalized, weight_axes, keepdims=True)
    beta_grad = tf.reduce_sum(upstream_wide, weight_axes, keepdims=True)
    scaled = upstream_wide * gamma
    scaled_mean = mean_of(scaled, stat_axes)
    projection = mean_of(scaled * normalized, stat_axes)
    x_grad = inverse_stddev * (scaled - scaled_mean - normalized * projection)
    return tf.cast(x_grad, x.dtype), gamma_grad, beta_grad


def normalize_by_size(x, gamma, beta, epsilon, stat_axes, output_dtype):
    """Return the formula by the sums measured faster at `x`'s run-time size.

    Inside a step traced for any batch size (as `fit(jit_compile=True)`
    traces a `tf.data` pipeline) XLA still compiles each shape it meets, with
    the size known: the choice (`_xla_sums_calibration.products_win_at_run_time`)
    is then a constant, and XLA folds each `tf.where` between the two forms'
    results to one and drops the other form's ops. No `tf.cond`: one on the
    size broke cond_v2's gradient of the products' custom gradient, and
    aborted the process in XLA's CPU runtime for the formula's branch. The
    gradient is analytic for both forms, and differentiable again (a
    gradient penalty then also computes the other form's second-order
    terms, times zero). The arguments are `keras_formula_normalize`'s.
    """
    products = _xla_sums_calibration.products_win_at_run_time(x.dtype, tf.size(x))

    def chosen(by_products, by_reductions):
        return tf.nest.map_structure(
            lambda a, b: tf.where(products, a, b), by_products, by_reductions
        )

    def forward(*arguments):
        return chosen(_FORWARD_BY_PRODUCTS(*arguments), formula_forward(*arguments))

    def backward(*arguments):
        return chosen(_BACKWARD_BY_PRODUCTS(*arguments), formula_backward(*arguments))

    return _saved_gradient.normalize_with(
        forward, backward, x, gamma, beta, epsilon, stat_axes, output_dtype
    )


_FORWARD_BY_PRODUCTS = functools.partial(
    formula_forward, mean_of=_product_means.middle_mean
)
_BACKWARD_BY_PRODUCTS = functools.partial(
    formula_backward, mean_of=_product_means.middle_mean
)

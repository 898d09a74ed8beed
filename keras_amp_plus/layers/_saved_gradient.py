"""A normalization path as a forward and the backward of what it saved.

The paths that carry their own gradient (`_keras_formula` outside XLA,
`_per_sample_batch_norm`, and every path behind `_size_switch`) are
written as `forward(x, gamma, beta, epsilon, stat_axes, output_dtype) ->
(outputs, saved)` and `backward(upstream, x, gamma, saved, epsilon,
stat_axes) -> (x_grad, gamma_grad, beta_grad)`; `normalize_with` joins the
two into one differentiable function.
"""

import tensorflow as tf


def normalize_with(forward, backward, x, gamma, beta, epsilon, stat_axes, dtype):
    """Return `forward`'s outputs for `x`, differentiated by `backward`.

    Args:
        forward: `forward(x, gamma, beta, epsilon, stat_axes, dtype)`
            returning `(outputs, saved)`.
        backward: `backward(upstream, x, gamma, saved, epsilon, stat_axes)`
            returning the gradients w.r.t. `(x, gamma, beta)`.
        x: the input.
        gamma: the scale.
        beta: the offset.
        epsilon: positive float added to the variance.
        stat_axes: the axes the statistics are taken over.
        dtype: the dtype of the result.

    Returns:
        `forward`'s outputs, differentiable w.r.t. `x`, `gamma` and `beta`.

    Example:
    >>> import tensorflow as tf
    >>> def forward(x, gamma, beta, epsilon, stat_axes, dtype):
    ...     return 2.0 * x, ()
    >>> def backward(upstream, x, gamma, saved, epsilon, stat_axes):
    ...     return 2.0 * upstream, 0.0 * gamma, 0.0 * gamma
    >>> x, one = tf.constant([1.0]), tf.constant([1.0])
    >>> with tf.GradientTape() as tape:
    ...     tape.watch(x)
    ...     y = normalize_with(forward, backward, x, one, one, 1e-3, (0,), "float32")
    >>> float(tape.gradient(y, x)[0])
    2.0
    """

    @tf.custom_gradient
    def normalize(x, gamma, beta):
        outputs, saved = forward(x, gamma, beta, epsilon, stat_axes, dtype)

        def grad(upstream):
            return backward(upstream, x, gamma, saved, epsilon, stat_axes)

        return outputs, grad

    return normalize(x, gamma, beta)

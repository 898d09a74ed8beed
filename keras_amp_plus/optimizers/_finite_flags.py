"""Is each gradient finite: exact flags, read from sums on finite steps.

A gradient is finite when every element is. Its sum says so at a lower cost
than `reduce_all(is_finite(g))` (one vectorized reduction, no bool tensor),
because Inf and NaN propagate through IEEE addition: a finite sum proves every
element finite. The converse fails only where the sum itself overflows, so
when any sum is not finite the exact flags are computed instead, in a
`tf.cond` branch that runs on such steps only. The flags are therefore the
exact ones on every step; only their cost differs. Float16 gradients, whose
sums overflow at 65504, always take the exact check, and so do gradients too
small in all for the sums to pay for the `tf.cond` (`SUMS_MIN_ELEMENTS`).

This relies on additions that honour Inf and NaN: TensorFlow's kernels, and
XLA's CPU backend, whose fast-math mode (which may assume neither occurs) is
off by default.
"""

import math

import tensorflow as tf

# Below this many gradient elements in all, the check's cost is its op count
# (the sums and the cond add ops), not its passes over memory.
SUMS_MIN_ELEMENTS = 1 << 17


def dense_values(gradient):
    """Return the values of a gradient as a tensor: an IndexedSlices' rows.

    `apply()` may be handed variables, NumPy arrays or lists as gradients;
    they are converted here, as `tf.math.is_finite` would convert them.
    """
    if isinstance(gradient, tf.IndexedSlices):
        return gradient.values
    return tf.convert_to_tensor(gradient)


def _exact_flag(values):
    return tf.reduce_all(tf.math.is_finite(values))


def _sum_flag(values):
    """Return True when `values` are all finite (False too when their sum overflows)."""
    if values.dtype == tf.float16:
        return _exact_flag(values)
    return tf.math.is_finite(tf.reduce_sum(values))


def _sums_pay(values):
    shapes = [v.shape for v in values]
    if any(shape.rank is None or None in shape for shape in shapes):
        return True  # unknown at trace time: likely a real model's gradients
    return sum(math.prod(shape) for shape in shapes) >= SUMS_MIN_ELEMENTS


def _arrange(flags, positions, num_tracked):
    """Order per-gradient `flags` as `finite_flags` returns them."""
    tracked = [None] * num_tracked
    untracked = []
    for flag, position in zip(flags, positions, strict=True):
        if position is None:
            untracked.append(flag)
        else:
            tracked[position] = flag
    flags = [tf.constant(True) if f is None else f for f in tracked] + untracked
    return tf.stack(flags)


def finite_flags(grads, positions, num_tracked):
    """Return a bool vector: is each gradient finite.

    Args:
        grads: the gradients: tensors (or what converts to one),
            IndexedSlices or None.
        positions: for each gradient, its variable's index among the
            scaler's `num_tracked` variables, or None for an untracked one.
        num_tracked: how many variables the scaler tracks.

    Returns:
        The first `num_tracked` entries follow the build order of the
        scaler's variables (True for a variable without a gradient); flags of
        untracked variables' gradients are appended after them, so they still
        count for the skip decision.

    Example:
    >>> import tensorflow as tf
    >>> grads = [tf.constant([1.0, float("inf")]), None, tf.constant([3e38, 3e38])]
    >>> finite_flags(grads, [1, 0, None], 2).numpy().tolist()
    [True, False, True]
    """
    pairs = zip(grads, positions, strict=True)
    present = [(dense_values(g), p) for g, p in pairs if g is not None]
    if not present and not num_tracked:
        return tf.ones([0], tf.bool)
    values = [v for v, _ in present]
    places = [p for _, p in present]

    def exact():
        return _arrange([_exact_flag(v) for v in values], places, num_tracked)

    if not values or not _sums_pay(values):
        return exact()
    quick = _arrange([_sum_flag(v) for v in values], places, num_tracked)
    return tf.cond(tf.reduce_all(quick), lambda: quick, exact)


def any_nan(grads):
    """Return a bool scalar: does any gradient hold a NaN."""
    flags = [
        tf.reduce_any(tf.math.is_nan(dense_values(g))) for g in grads if g is not None
    ]
    return tf.reduce_any(tf.stack(flags)) if flags else tf.constant(False)

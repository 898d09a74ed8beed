"""Eager calls compile the layers' XLA kernels only for shapes that come back.

XLA compiles a kernel per input shape. A graph step traces its shapes once
and runs them for the whole `fit`; eager calls (a notebook's `model(image)`
per image, a decoding loop's growing sequence) may bring a new shape every
time, and one compilation costs hundreds of such calls. So an eager call at a
shape met for the first time runs plain TensorFlow ops (the centred
formula, statistics in float32; Keras's `silu` widened), and the kernels
compile when the same shape comes back: a loop at one shape runs them from
its second call on, calls at ever new shapes never wait for a compiler.
"""

import collections
import threading

# Shapes remembered, the least recently called forgotten first: more than a
# decoding loop's lengths or a notebook's image sizes.
_REMEMBERED_SHAPES = 4096

_seen = collections.OrderedDict()
_lock = threading.Lock()


def seen_before(kind: str, x, *details) -> bool:
    """Record an eager call on `x`; return whether one came at its shape before.

    Args:
        kind: the computation called (its kernels), e.g. `"normalize"`.
        x: the input tensor; its shape and dtype are recorded.
        *details: whatever else decides the kernels (hashable).

    Returns:
        True from the second call of `kind` with `x`'s shape, dtype and
        `details` on (while remembered), False at the first.

    Example:
    >>> import tensorflow as tf
    >>> x = tf.zeros((2, 3))
    >>> seen_before("doctest", x), seen_before("doctest", x)
    (False, True)
    """
    key = (kind, tuple(x.shape), x.dtype.name, *details)
    with _lock:
        if key in _seen:
            _seen.move_to_end(key)
            return True
        _seen[key] = None
        if len(_seen) > _REMEMBERED_SHAPES:
            _seen.popitem(last=False)
        return False

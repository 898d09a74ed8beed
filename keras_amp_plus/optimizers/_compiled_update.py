"""The inner optimizer's update compiled with XLA: one fused loop per variable.

Keras 3's TensorFlow optimizers update each variable with a chain of
element-wise ops (Adam: about ten passes over every weight and its two slots),
each its own kernel in a graph step. XLA fuses the chain into one loop per
variable, as Keras 2's optimizers did with `jit_compile=True`; the values are
the same up to rounding.

It applies only where a nested XLA function may update variables: in a graph
step that XLA does not compile already, without a distribution strategy (TF
refuses the optimizer's `merge_call` inside a nested function under
`MirroredStrategy`), on Keras 3 (Keras 2's optimizers compile their own), and
only to variables large enough to pay for launching an XLA computation
(`benchmarks/fused_update.py` measures where that is).
"""

import math

import tensorflow as tf

from keras_amp_plus import _compat

# Below this many elements in all the updated variables together the fixed
# cost of an XLA launch outweighs the passes it saves.
MIN_ELEMENTS = 1 << 17


def can_compile_update(variables) -> bool:
    """Return True when updating `variables` may run as a nested XLA function."""
    return (
        _compat.UPDATES_BENEFIT_FROM_XLA
        and tf.inside_function()
        and not tf.distribute.has_strategy()
        and not _compat.in_xla_compiled_function()
        and _element_count(variables) >= MIN_ELEMENTS
    )


def _element_count(variables) -> int:
    return sum(math.prod(v.shape) for v in variables if None not in v.shape)


class CompiledUpdates:
    """One XLA function per list of variables an optimizer updates.

    Variables are captured, not passed: a Keras variable is no `tf.function`
    argument. A step traced again (a rebuilt train function) reuses the
    function of its variable list.
    """

    def __init__(self):
        self._functions = {}

    def run(self, update, grads, variables) -> None:
        """Run `update(grads, variables)` compiled with XLA."""
        key = None if variables is None else tuple(id(v) for v in variables)
        function = self._functions.get(key)
        if function is None:
            function = tf.function(
                lambda grads: update(grads, variables),
                jit_compile=True,
                autograph=False,
            )
            self._functions[key] = function
        function(list(grads))

"""The Keras and TensorFlow names our scaler depends on (see _compat.py)."""

import keras
import tensorflow as tf

import keras_amp_plus
from keras_amp_plus import _compat
from keras_amp_plus.optimizers import LossScaleOptimizer


def test_is_a_keras_loss_scale_optimizer():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD())
    assert isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    assert isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer)


def test_keras_names_the_subclass_depends_on_still_exist():
    # If this fails, Keras renamed a private hook our `apply()` replaces or an
    # attribute we read: re-check keras_amp_plus/optimizers/_apply_step.py.
    keras_class = keras.optimizers.LossScaleOptimizer
    for name in _compat.KERAS_LOSS_SCALE_BYPASSED_HOOKS:
        assert callable(getattr(keras_class, name, None)), name
    built = keras_class(keras.optimizers.SGD())
    built.build([keras.Variable([1.0])])
    for name in _compat.KERAS_LOSS_SCALE_ATTRIBUTES:
        assert hasattr(built, name), name
    assert LossScaleOptimizer.apply is not keras_class.apply
    assert isinstance(_compat.strategy_supports_no_merge_call(), bool)


def test_xla_trace_is_detected():
    seen = {}

    def probe():
        seen[len(seen)] = _compat.in_xla_compiled_function()
        return tf.constant(0)

    tf.function(probe, jit_compile=True)()
    tf.function(probe)()
    assert seen == {0: True, 1: False}


def test_exported_at_the_package_top_level():
    assert keras_amp_plus.LossScaleOptimizer is LossScaleOptimizer

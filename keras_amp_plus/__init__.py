"""keras_amp_plus: advanced mixed precision for Keras on Intel CPUs and XPUs.

Three things users do:

1. swap in the mixed-precision layers of `keras_amp_plus.layers`;
2. wrap their optimizer in `keras_amp_plus.optimizers.LossScaleOptimizer`;
3. add `keras_amp_plus.callbacks.AMPMonitor(log_dir)` to `model.fit`.
"""

from keras_amp_plus import _compat

_compat.check_tensorflow_backend()

__version__ = "0.1.0"

__all__ = ["__version__"]

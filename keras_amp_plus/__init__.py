"""keras_amp_plus: advanced mixed precision for Keras on Intel CPUs and XPUs.

Three things users do:

1. swap in the mixed-precision layers of `keras_amp_plus.layers`;
2. wrap their optimizer in `keras_amp_plus.optimizers.LossScaleOptimizer`;
3. add `keras_amp_plus.callbacks.AMPMonitor(log_dir)` to `model.fit`.
"""

from keras_amp_plus import _compat

_compat.check_tensorflow_backend()

from keras_amp_plus import callbacks  # noqa: E402
from keras_amp_plus import engines  # noqa: E402
from keras_amp_plus import layers  # noqa: E402
from keras_amp_plus import optimizers  # noqa: E402
from keras_amp_plus.callbacks import AMPMonitor  # noqa: E402
from keras_amp_plus.optimizers import LossScaleOptimizer  # noqa: E402
from keras_amp_plus.policy import PrecisionLists  # noqa: E402
from keras_amp_plus.report import precision_report  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "AMPMonitor",
    "LossScaleOptimizer",
    "PrecisionLists",
    "__version__",
    "callbacks",
    "engines",
    "layers",
    "optimizers",
    "precision_report",
]

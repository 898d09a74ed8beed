"""keras_amp_plus: advanced mixed precision for Keras on Intel CPUs and XPUs.

Three things users do:

1. swap in the mixed-precision layers of `keras_amp_plus.layers`;
2. wrap their optimizer in `keras_amp_plus.optimizers.LossScaleOptimizer`;
3. add `keras_amp_plus.callbacks.AMPMonitor(log_dir)` to `model.fit`.

The names below are imported on first use, so `python -m keras_amp_plus
doctor` runs (and reports the problem) even where Keras is on another backend
or TensorFlow is broken; using any of them checks the backend first.
"""

import importlib

__version__ = "0.1.0"

# Public name -> (module, attribute or None for the module itself).
_EXPORTS = {
    "AMPMonitor": ("keras_amp_plus.callbacks", "AMPMonitor"),
    "LossScaleOptimizer": ("keras_amp_plus.optimizers", "LossScaleOptimizer"),
    "PrecisionLists": ("keras_amp_plus._lists.precision_lists", "PrecisionLists"),
    "precision_report": ("keras_amp_plus._report", "precision_report"),
    "callbacks": ("keras_amp_plus.callbacks", None),
    "engines": ("keras_amp_plus.engines", None),
    "layers": ("keras_amp_plus.layers", None),
    "optimizers": ("keras_amp_plus.optimizers", None),
}

__all__ = sorted([*_EXPORTS, "__version__"])


def __getattr__(name):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'keras_amp_plus' has no attribute {name!r}")
    module_name, attribute = _EXPORTS[name]
    module = importlib.import_module(module_name)
    value = module if attribute is None else getattr(module, attribute)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__():
    return sorted([*globals(), *_EXPORTS])

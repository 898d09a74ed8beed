"""keras_amp_plus: advanced mixed precision for Keras on Intel CPUs and XPUs.

Three things users do:

1. swap in the mixed-precision layers of `keras_amp_plus.layers`;
2. wrap their optimizer in `keras_amp_plus.optimizers.LossScaleOptimizer`;
3. add `keras_amp_plus.callbacks.AMPMonitor(log_dir)` to `model.fit`.

The layers and the scaler are imported with the package, so that
`keras.saving.load_model` finds them in a saved model; the other names on
first use. `python -m keras_amp_plus doctor` imports none of them first, so
it runs (and reports the problem) even where Keras is on another backend or
TensorFlow is broken; using any name checks the backend first.
"""

import importlib
import sys

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


def _running_the_command_line() -> bool:
    """Return whether this process is `python -m keras_amp_plus ...`.

    Not `python -m` of another package that imports this one (`sys.argv[0]`
    is "-m" while any `-m` target's parent packages are imported).
    """
    arguments = getattr(sys, "orig_argv", [])
    module = _module_argument(arguments[1:])
    if module is None:
        return False
    return module == "keras_amp_plus" or module.startswith("keras_amp_plus.")


def _module_argument(options: list) -> str | None:
    """Return the module of Python's `-m` option in `options`, or None.

    `options` are the interpreter's arguments after its name: `-m mod`,
    `-mmod` and flags grouped with it (`-Bm mod`) name a module; a script or
    `-c` ends the interpreter's options. `-W` and `-X` take a value.
    """
    position = 0
    while position < len(options):
        option = options[position]
        position += 1
        if option == "--" or not option.startswith("-") or option == "-":
            return None
        if option.startswith("--"):
            position += option == "--check-hash-based-pycs"  # takes a value
            continue
        for index, flag in enumerate(option[1:], start=1):
            rest = option[index + 1 :]
            if flag == "c":
                return None
            if flag in "mWX":
                value = rest or (options[position] if position < len(options) else None)
                position += not rest
                if flag == "m":
                    return value
                break
    return None


def _require_tensorflow() -> None:
    """Raise ImportError, saying what to install, where TensorFlow is missing.

    TensorFlow is no hard dependency of the package: a hard `tensorflow-cpu`
    would install over a `tensorflow` (or an accelerator's build) already
    there, so it is the `[cpu]` extra. Not under `python -m keras_amp_plus`,
    whose `doctor` reports it.
    """
    if _running_the_command_line():
        return
    try:
        import tensorflow  # noqa: F401
    except ModuleNotFoundError as error:
        if (error.name or "").partition(".")[0] != "tensorflow":
            raise  # TensorFlow is there; something it imports is not
        raise ImportError(
            "keras_amp_plus needs TensorFlow, which is not installed. Install the "
            'CPU build with `pip install "keras-amp-plus[cpu]"` (tensorflow-cpu), '
            "or `tensorflow` (or your accelerator's build) yourself. "
            f"Received: {error!r}"
        ) from error


_require_tensorflow()


def _register_serializables() -> None:
    """Import the layers and the scaler, registering them with Keras's saving.

    `keras.saving.load_model` finds the classes of a saved model by their
    registered names ("keras_amp_plus>Swish", ...), so a script that only
    does `import keras_amp_plus` and loads a `.keras` file needs them
    registered at import. Not under `python -m keras_amp_plus` (the command
    line, whose `doctor` reports a broken TensorFlow or another Keras backend
    instead of failing on it), and not where the import fails: then using a
    name raises the error, as before.
    """
    if _running_the_command_line():
        return
    try:
        importlib.import_module("keras_amp_plus.layers")
        importlib.import_module("keras_amp_plus.optimizers")
    except Exception:  # reported when a name is used
        return


_register_serializables()


def __dir__():
    return sorted([*globals(), *_EXPORTS])

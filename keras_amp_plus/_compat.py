"""The one place that knows one Keras from another.

Everything that differs between Keras 3 (stock TensorFlow >= 2.16, the primary
stack) and Keras 2.15 (`tf.keras`, the ITEX stack that a later issue adds) lives
here, so the rest of the package is written once against these names. Code inside
a layer's `call` uses `tf.*` ops, which run the same under both.

When a private Keras or TensorFlow name is unavoidable it is reached from this
module only, with a comment saying why.
"""

import os

import keras
import tensorflow as tf

KERAS_MAJOR = int(keras.__version__.split(".")[0])
IS_KERAS_3 = KERAS_MAJOR >= 3

if not IS_KERAS_3:  # pragma: no cover - the ITEX-stack issue fills this in.
    raise ImportError(
        "keras_amp_plus needs Keras 3 with the TensorFlow backend. "
        f"Received: keras=={keras.__version__}. Keras 2 (the ITEX stack) is not "
        "supported yet; install `keras>=3.3`."
    )


def check_tensorflow_backend() -> None:
    """Raise a clear error unless Keras runs on the TensorFlow backend."""
    backend = keras.backend.backend()
    if backend != "tensorflow":
        raise RuntimeError(
            "keras_amp_plus works with the TensorFlow backend only (graph AMP, "
            "ITEX and TensorBoard are TensorFlow things). Set "
            "`KERAS_BACKEND=tensorflow` before importing Keras. "
            f"Received: backend={backend!r}"
        )


def dtype_policy(name):
    """Return the Keras dtype policy object for a policy name or policy."""
    return keras.dtype_policies.get(name)


def global_policy():
    """Return the global Keras dtype policy."""
    return keras.config.dtype_policy()


def set_global_policy(policy) -> None:
    """Set the global Keras dtype policy."""
    keras.config.set_dtype_policy(policy)


def layer_path(layer) -> str:
    """Return the layer's unique path (Keras 3 `Layer.path`)."""
    return layer.path


def variable_path(variable) -> str:
    """Return the variable's unique path (Keras 3 `Variable.path`)."""
    return variable.path


def add_float32_weight(layer, name, shape, initializer, regularizer, constraint):
    """Add a trainable float32 weight that is never autocast to the compute dtype.

    Mixed-precision layers keep gamma/beta-like weights in float32 and do their
    own casting; Keras 3 spells that `autocast=False`.
    """
    return layer.add_weight(
        name=name,
        shape=shape,
        initializer=initializer,
        regularizer=regularizer,
        constraint=constraint,
        dtype="float32",
        autocast=False,
        trainable=True,
    )


def env_flag(name: str) -> bool:
    """Return True when an environment variable is set to a truthy value."""
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def itex_module():
    """Return `intel_extension_for_tensorflow` when importable, else None.

    ITEX imports Keras 2 internals, so on the Keras 3 stack the import fails even
    when the wheel is present; both cases mean "no ITEX here".
    """
    try:
        import intel_extension_for_tensorflow as itex
    except Exception:  # noqa: BLE001 - any import failure means no usable ITEX
        return None
    return itex


__all__ = ["IS_KERAS_3", "KERAS_MAJOR", "tf"]


def onednn_enabled() -> bool | None:
    """Return whether TensorFlow's oneDNN (MKL) kernels are on, or None if unknown.

    TensorFlow has no public API for this. `IsMklEnabled` is the function TF's own
    tests use; it reads `TF_ENABLE_ONEDNN_OPTS` and the build's default exactly as
    the kernels do, so it is reached privately here (used by the doctor).
    """
    try:
        from tensorflow.python.util import _pywrap_util_port
    except ImportError:
        return None
    return bool(_pywrap_util_port.IsMklEnabled())


def flatten_layers(layer) -> list:
    """Return every layer nested inside `layer` (recursively), itself excluded.

    Keras 3 has no public recursive walk (`Model.layers` is one level deep), so
    this uses `Layer._flatten_layers`, which Keras itself relies on for saving.
    """
    return list(layer._flatten_layers(include_self=False, recursive=True))


def reset_grappler_option(name: str) -> None:
    """Forget a grappler option so it is back to "not set" (DEFAULT).

    `tf.config.optimizer.set_experimental_options` can only set an option ON or
    OFF; restoring a never-set option exactly needs the private eager context.
    The public setter is then called with no changes so that TF drops its cached
    function-call options, exactly as it does after a real change.
    """
    from tensorflow.python.eager import context

    context.context()._optimizer_experimental_options.pop(name, None)
    tf.config.optimizer.set_experimental_options({})

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


# Every public module imports this one: fail at import, not in the first step.
check_tensorflow_backend()


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
    except Exception:
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


def direct_sublayers(layer) -> list:
    """Return the layers directly inside `layer` (one level, itself excluded).

    Why private: the monitor names layers by the chain of names from the model
    down, which needs the parent of each layer; `Model.layers` is public but
    plain layers with sublayers (MultiHeadAttention) have no public listing.
    """
    return list(layer._flatten_layers(include_self=False, recursive=False))


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


# --- LossScaleOptimizer (keras_amp_plus/optimizers) ---------------------------
# Our LossScaleOptimizer subclasses `keras.optimizers.LossScaleOptimizer` and
# replaces its public `apply()` whole (finiteness is computed once per gradient
# and reused for the skip decision and the per-variable record). Keras's private
# TensorFlow hooks below are therefore bypassed, not overridden, and the public
# attributes below are read from Keras's `build()`. If Keras renames or starts
# routing training through any of them, tests/test_loss_scale_compat.py fails.
KERAS_LOSS_SCALE_BYPASSED_HOOKS = (
    "_tf_apply",
    "_common_apply",
    "_stateful_handle_finite_grads",
    "_stateful_handle_non_finite_grads",
    "check_finite",
)
KERAS_LOSS_SCALE_ATTRIBUTES = (
    "step_counter",
    "dynamic_scale",
    "inner_optimizer",
    "initial_scale",
    "dynamic_growth_steps",
)


def strategy_supports_no_merge_call() -> bool:
    """Return True when the current strategy can update state in replica context.

    Why private: Keras's own scaler chooses between its replica-context and
    `merge_call` paths with this TF helper; TF has no public equivalent.
    """
    return tf.__internal__.distribute.strategy_supports_no_merge_call()


def call_for_each_replica(strategy, fn, args):
    """Run `fn(*args)` on every replica from inside `merge_call`.

    Why: in cross-replica context `strategy.run` is not allowed; Keras's scaler
    uses `StrategyExtended.call_for_each_replica` (public only in tf.compat.v1).
    """
    return strategy.extended.call_for_each_replica(fn, args=args)


def itex_layer_norm_op():
    """Return ITEX's fused layer-norm op (`itex_layer_norm`), or None.

    ITEX publishes the kernel only inside `itex.ops.LayerNormalization`, a
    tf.keras (Keras 2) layer; the raw op lives in ITEX's private
    `load_ops_library` module, reached from here so no other module touches it.
    Its gradient is registered when ITEX is imported.
    """
    if itex_module() is None:
        return None
    try:  # pragma: no cover - needs the ITEX stack
        from intel_extension_for_tensorflow.python.ops.load_ops_library import (
            load_ops_library,
        )
    except Exception:  # an ITEX without the op: use ours
        return None
    return getattr(load_ops_library, "itex_layer_norm", None)  # pragma: no cover


def register_activation_name(name: str, function) -> None:
    """Let `keras.activations.get(name)` (and so `Dense(activation=name)`) work.

    Why private: Keras 3's `activations.get` resolves strings only through its
    module table `keras.src.activations.ALL_OBJECTS_DICT`, not through the
    registered custom objects, so a registered function's name is otherwise
    accepted in configs (dict form) but not as a plain string. Built-in names
    are never replaced.
    """
    from keras.src import activations as keras_activations

    keras_activations.ALL_OBJECTS_DICT.setdefault(name, function)


def in_xla_compiled_function() -> bool:
    """Return True while tracing a `tf.function(jit_compile=True)`.

    Keras's train step is such a function under `compile(jit_compile=True)`.
    Why private: XLA cannot compile `tf.py_function` or `Assert`, so the loss
    scaler's `on_min_scale` action must move to the host there. TF marks such a
    trace with an XLA control-flow context and has no public test for it
    (MirroredStrategy uses this same check).
    """
    from tensorflow.python.ops import control_flow_util

    graph = tf.compat.v1.get_default_graph()
    return control_flow_util.GraphOrParentsInXlaContext(graph)

"""The one place that knows one Keras from another.

Everything that differs between Keras 3 (stock TensorFlow >= 2.16, the primary
stack) and Keras 2.15 (`tf.keras`, the ITEX stack: TensorFlow 2.15 + Intel
Extension for TensorFlow) lives here, so the rest of the package is written once
against these names. Code inside a layer's `call` uses `tf.*` ops, which run the
same under both. The loss scaler's Keras 2 base class is built here too
(`_make_keras2_loss_scale_base`), only on that stack.

When a private Keras or TensorFlow name is unavoidable it is reached from this
module only, with a comment saying why.
"""

import contextlib
import functools
import re

import keras
import tensorflow as tf

KERAS_VERSION = tuple(int(part) for part in re.findall(r"\d+", keras.__version__)[:2])
KERAS_MAJOR = KERAS_VERSION[0]
IS_KERAS_3 = KERAS_MAJOR >= 3

# Keras 3 before 3.10 lacks `Layer.path` (before 3.4) and casts a functional
# model's inputs where no layer's dtype policy reaches (before 3.10), so a
# denied layer still overflows there.
if not (KERAS_VERSION >= (3, 10) or KERAS_VERSION == (2, 15)):
    raise ImportError(
        "keras_amp_plus needs Keras >= 3.10 (TensorFlow >= 2.16) or, on the ITEX "
        "stack, Keras 2.15 with TensorFlow 2.15. Install `keras>=3.10`, or see "
        f"the README's ITEX section. Received: keras=={keras.__version__}"
    )


# `compile(jit_compile=...)`'s default: Keras 3 resolves "auto" itself; Keras 2
# takes None (XLA off unless the model asks for it).
JIT_COMPILE_DEFAULT = "auto" if IS_KERAS_3 else None
# What to tell a user whose `jit_compile=True` cannot run: Keras 3's "auto"
# turns XLA off where it cannot; Keras 2 takes any true value, "auto" too, for
# XLA on.
JIT_COMPILE_OFF_ADVICE = (
    "Keras's default `jit_compile='auto'` turns XLA off under tf.distribute for "
    "this reason. Compile the model with `jit_compile=False` (or 'auto')"
    if IS_KERAS_3
    else "Compile the model with `jit_compile=False` (Keras 2's default; "
    "Keras 2 reads any true value, 'auto' too, as XLA on)"
)


def jit_compile_on(model) -> bool:
    """Return whether `fit` compiles the model's step with XLA.

    Keras 3 resolves `jit_compile="auto"` to a bool at `compile`; Keras 2
    keeps what it was given and compiles with XLA for any true value.
    """
    if IS_KERAS_3:
        return model.jit_compile is True
    return bool(model.jit_compile)


# What the rest of the package asks about, rather than the Keras version:
# `keras.Operation`, to record a function applied to a symbolic KerasTensor;
HAS_KERAS_OPERATIONS = IS_KERAS_3
# Keras 3's TF optimizers update each variable with a chain of element-wise
# kernels, which one nested XLA function fuses (Keras 2's `jit_compile`
# optimizers compile their own update);
UPDATES_BENEFIT_FROM_XLA = IS_KERAS_3
# grappler's remapper fusing `x * sigmoid(x)` into oneDNN's bfloat16 swish
# kernel, measured and tested on TensorFlow >= 2.16 only.
ONEDNN_SWISH_FUSION = IS_KERAS_3


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
    if IS_KERAS_3:
        return keras.dtype_policies.get(name)
    if isinstance(name, keras.mixed_precision.Policy):
        return name
    return keras.mixed_precision.Policy(name)


def global_policy():
    """Return the global Keras dtype policy."""
    if IS_KERAS_3:
        return keras.config.dtype_policy()
    return keras.mixed_precision.global_policy()


def set_global_policy(policy) -> None:
    """Set the global Keras dtype policy."""
    if IS_KERAS_3:
        keras.config.set_dtype_policy(policy)
    else:
        keras.mixed_precision.set_global_policy(policy)


def standardize_dtype(dtype) -> str:
    """Return a dtype's name ("float32", "bfloat16", ...) for any dtype spelling."""
    if IS_KERAS_3:
        return keras.backend.standardize_dtype(dtype)
    return tf.as_dtype(dtype).name


def layer_path(layer) -> str:
    """Return the layer's unique path (Keras 3 `Layer.path`).

    Keras 2 has no paths; a layer's name is unique inside its model there.
    """
    return layer.path if IS_KERAS_3 else layer.name


def computes_under_parent_policy(layer, parent) -> bool:
    """Return whether `parent` runs `layer` under `parent`'s dtype policy.

    Keras 3's `TimeDistributed` runs its layer by `self.layer.call(...)`, not
    through the layer's `__call__`: the inputs arrive cast to the wrapper's
    compute dtype and the variables are read in the wrapper's autocast
    scope, whatever the wrapped layer's own policy says. Keras 2's calls
    the layer, whose own policy then applies.
    """
    return (
        IS_KERAS_3
        and isinstance(parent, keras.layers.TimeDistributed)
        and parent.layer is layer
    )


def variable_path(variable) -> str:
    """Return the variable's unique path (Keras 3 `Variable.path`).

    Keras 2 variables have TF names such as "dense/kernel:0": the output index
    is dropped so the path reads like Keras 3's "dense/kernel".
    """
    if IS_KERAS_3:
        return variable.path
    name = variable.name
    return name[:-2] if name.endswith(":0") else name


def build_from_config(layer, config, build) -> None:
    """Run `build(config)`, Keras's `build_from_config`, under `layer`'s name.

    Keras 2 builds a custom layer reloaded from a `.keras` file outside its
    name scope: its variables would be named "gamma:0" instead of
    "ln/gamma:0", the same for every such layer, and `variable_path` (what
    the scaler's records and the monitor's attribution go by) would no longer
    tell them apart. Keras 3 names variables by their layer's path itself.
    """
    if IS_KERAS_3:
        build(config)
        return
    with tf.name_scope(layer.name):
        build(config)


def no_autocast() -> dict:
    """Return the `add_weight` keyword that keeps a weight out of autocasting.

    Mixed-precision layers keep gamma/beta-like weights in float32 and do their
    own casting; Keras 3 spells that `autocast=False`, Keras 2
    `experimental_autocast=False`.
    """
    return {"autocast": False} if IS_KERAS_3 else {"experimental_autocast": False}


def disable_input_autocast(layer) -> None:
    """Stop the base layer from casting the inputs to the compute dtype.

    Keras 3's public attribute is `autocast`; Keras 2 reads the private
    `_autocast` (there is no public switch).
    """
    if IS_KERAS_3:
        layer.autocast = False
    else:
        layer._autocast = False


_POLICY_CLASS_NAMES = ("Policy", "DTypePolicy")  # Keras 2's, Keras 3's


def portable_layer_config(config: dict) -> dict:
    """Return a layer config saved by either Keras, in a form this one loads.

    Keras 2 saves the dtype policy as `{"class_name": "Policy", "module":
    "keras.mixed_precision", ...}` and Keras 3 as `{"class_name": "DTypePolicy",
    "module": "keras", ...}`; neither loads the other's, but both load the
    policy's name. Keras 3's `LayerNormalization` config also has
    `rms_scaling`, which Keras 2's layer does not know: dropped when False.
    """
    config = dict(config)
    dtype = config.get("dtype")
    if isinstance(dtype, dict) and dtype.get("class_name") in _POLICY_CLASS_NAMES:
        config["dtype"] = dtype.get("config", {}).get("name", dtype)
    if not IS_KERAS_3 and "rms_scaling" in config:
        if config["rms_scaling"]:
            raise ValueError(
                "This LayerNormalization config uses Keras 3's `rms_scaling=True`, "
                "which Keras 2.15 does not have. Load it with Keras 3, or save it "
                "with rms_scaling=False. Received: rms_scaling=True"
            )
        config.pop("rms_scaling")
    return config


def set_layer_policy(layer, policy) -> None:
    """Give a built layer another dtype policy (its variables stay as they are).

    Keras 3 has a public setter; Keras 2's `dtype_policy` is read-only and its
    own constructor goes through the private `_set_dtype_policy`.
    """
    if IS_KERAS_3:
        layer.dtype_policy = policy
    else:
        layer._set_dtype_policy(policy)


def is_legacy_optimizer(optimizer) -> bool:
    """Return True for Keras 2's `tf.keras.optimizers.legacy.*` (Keras 3: none).

    Their state, update and loss scaler (`OptimizerV2`) differ from the
    current optimizers' that the scaler subclasses and the monitor reads.
    """
    return not IS_KERAS_3 and isinstance(optimizer, keras.optimizers.legacy.Optimizer)


LEGACY_OPTIMIZER_ADVICE = (
    "Keras 2's legacy optimizers (`tf.keras.optimizers.legacy.*`) are not "
    "supported: use the current one of the same name, e.g. "
    "`tf.keras.optimizers.Adam()`"
)


def reads_weights_in_compute_dtype(layer) -> bool:
    """Return whether `layer`, given a mixed policy, reads its weights in 16 bits.

    Keras 3 casts a layer's variables to its compute dtype when they are read.
    Keras 2 casts only `AutoCastVariable`s, which a layer creates when built
    under a mixed policy: one built under float32 (a float32 model's, or one
    reloaded from a file that saved it so) holds plain float32 variables,
    which ops such as Dense's and Conv2D's would meet with 16-bit inputs.
    Layers whose weights skip autocasting by design cast them themselves:
    Keras 2's BatchNormalization, LayerNormalization and Embedding, this
    package's and ITEX's layers.
    """
    if IS_KERAS_3 or _casts_its_own_weights(layer):
        return True
    # Keras 2's class, private: the one way to tell a variable it casts.
    from keras.src.mixed_precision.autocast_variable import AutoCastVariable

    floats = [weight for weight in layer.weights if weight.dtype.is_floating]
    return not floats or any(isinstance(w, AutoCastVariable) for w in floats)


def uncast_consumers(layer) -> list:
    """Return the layers `layer`'s outputs feed that cast no inputs (Keras 3: none).

    Keras 2 turns `+`, `*` and `tf.*` calls on a functional model's tensors
    into `TFOpLambda` layers built with `autocast=False`: handed a float32
    and a 16-bit tensor (`h + r`), they fail the step. One of one input
    (`tf.nn.relu(h)`, `h * 0.5`) mixes nothing but hands the dtype on: the
    layers it feeds are looked at in turn. Keras 3's operations promote.
    """
    if IS_KERAS_3:
        return []
    found = []
    # Keras 2's functional graph, private: the one way to find such layers
    # before a step fails on them. Other layers built without autocasting
    # (this package's normalizations) cast their inputs themselves.
    for node in getattr(layer, "_outbound_nodes", ()):
        consumer = node.outbound_layer
        if type(consumer).__module__ != _KERAS_2_OP_LAYERS:
            continue
        if len(tf.nest.flatten(node.keras_inputs)) > 1:
            found.append(consumer)
        else:
            found.extend(uncast_consumers(consumer))
    return found


# Private Keras 2 module of the op layers (`TFOpLambda`, ...): no public name.
_KERAS_2_OP_LAYERS = "keras.src.layers.core.tf_op_layer"


_SELF_CASTING_PACKAGES = ("keras_amp_plus.", "intel_extension_for_tensorflow.")


def _casts_its_own_weights(layer) -> bool:
    """Return whether a Keras 2 layer's weights skip autocasting by design."""
    layers = keras.layers
    if isinstance(layer, layers.BatchNormalization | layers.LayerNormalization):
        return True
    if isinstance(layer, layers.Embedding):
        return True
    modules = (cls.__module__ for cls in type(layer).__mro__)
    return any(module.startswith(_SELF_CASTING_PACKAGES) for module in modules)


def uses_rms_scaling(layer) -> bool:
    """Return Keras 3's deprecated `LayerNormalization.rms_scaling` (Keras 2: no)."""
    return bool(getattr(layer, "rms_scaling", False))


@functools.cache
def itex_module():
    """Return `intel_extension_for_tensorflow` when importable, else None.

    ITEX imports Keras 2 internals, so on the Keras 3 stack the import fails even
    when the wheel is present; both cases mean "no ITEX here". Cached: a failed
    import would otherwise be retried at every layer call.
    """
    try:
        import intel_extension_for_tensorflow as itex
    except Exception:
        return None
    return itex


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


ITEX_LAYER_NORM_DTYPES = (tf.float32, tf.bfloat16, tf.float16)


def itex_layer_norm_op(input_dtype=tf.float32):
    """Return ITEX's fused layer-norm op (`itex_layer_norm`), or None.

    ITEX publishes the kernel only inside `itex.ops.LayerNormalization`, a
    tf.keras (Keras 2) layer; the raw op lives in ITEX's private
    `load_ops_library` module, reached from here so no other module touches it.
    Its gradient is registered when ITEX is imported. None as well for inputs
    the kernel has no version for (float64) and inside XLA-compiled functions
    (XLA cannot compile ITEX's custom op).
    """
    if tf.as_dtype(input_dtype) not in ITEX_LAYER_NORM_DTYPES:
        return None
    if itex_module() is None or in_xla_compiled_function():
        return None
    try:  # pragma: no cover - needs the ITEX stack
        from intel_extension_for_tensorflow.python.ops.load_ops_library import (
            load_ops_library,
        )
    except Exception:  # an ITEX without the op: use ours
        return None
    return getattr(load_ops_library, "itex_layer_norm", None)  # pragma: no cover


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


# Keras 3 reads `jit_compile` when `make_train_function` builds `fit`'s step;
# Keras 2.15 reads it later, when that step is first traced inside `fit`.
CAN_BUILD_TRAIN_FUNCTION_WITHOUT_XLA = IS_KERAS_3


@contextlib.contextmanager
def train_function_built_without_xla(model):
    """Build `fit`'s step in this block as a plain graph function (no XLA).

    Keras 3 only (see `CAN_BUILD_TRAIN_FUNCTION_WITHOUT_XLA`). The monitor
    compiles the model's own `train_step` with XLA itself and keeps its batch
    stash outside (see `StepRecorder`).
    """
    previous = model.jit_compile
    model.jit_compile = False
    try:
        yield
    finally:
        model.jit_compile = previous


# --- The loss scaler's base class -------------------------------------------
# Keras 3: `keras.optimizers.LossScaleOptimizer`, subclassed as is. Keras 2.15:
# the exported `tf.keras.mixed_precision.LossScaleOptimizer` is a metaclass
# dispatcher; new-style optimizers get `LossScaleOptimizerV3`, reachable only
# from `keras.src` (hence here). `Keras2LossScaleBase` gives it the Keras 3
# surface our scaler is written against: `apply(grads, variables)`,
# `scale_loss`, `add_variable(..., aggregation=...)`, `dynamic_scale`,
# `step_counter`; `minimize`/`apply_gradients` (what Keras 2's `fit` calls)
# route into `apply`.


def _make_keras2_loss_scale_base():
    # Keras 2's scaler class and its "you forgot to scale" warning are reached
    # in its private module: `tf.keras.mixed_precision.LossScaleOptimizer` is
    # a factory, not the class to subclass.
    from keras.src.mixed_precision import loss_scale_optimizer as keras2_scaler

    class Keras2LossScaleBase(keras2_scaler.LossScaleOptimizerV3):
        """`LossScaleOptimizerV3` with the Keras 3 scaler's method names."""

        # As in Keras's own constructor: the scaler delegates its tracking to
        # the inner optimizer, so plain attributes must not become children.
        @tf.__internal__.tracking.no_automatic_dependency_tracking
        def __init__(
            self,
            inner_optimizer,
            initial_scale=2.0**15,
            dynamic_growth_steps=2000,
            name=None,
            dynamic=True,
            **kwargs,
        ):
            if dynamic is not True:
                raise ValueError(
                    "keras_amp_plus's LossScaleOptimizer is always dynamic; for a "
                    "fixed scale pass min_scale == max_scale == initial_scale. "
                    f"Received: dynamic={dynamic!r}"
                )
            if kwargs:
                raise TypeError(
                    "keras_amp_plus's LossScaleOptimizer takes no other keyword "
                    "arguments on Keras 2 (optimizer options belong to the inner "
                    f"optimizer). Received: {sorted(kwargs)}"
                )
            super().__init__(
                inner_optimizer,
                dynamic=True,
                initial_scale=initial_scale,
                dynamic_growth_steps=dynamic_growth_steps,
            )
            self.name = name or "loss_scale_optimizer"
            self.built = False
            self._own_variables = []

        def build(self, var_list):
            super().build(var_list)
            self.built = True  # as Keras 3's optimizers say it

        def get_config(self):
            # Keras 2's leaves the name out (Keras 3's keeps it).
            return {**super().get_config(), "name": self.name}

        @property
        def dynamic_scale(self):
            return self._loss_scale.current_loss_scale

        @property
        def step_counter(self):
            return self._loss_scale.counter

        @property
        def variables(self):
            # Keras 2's scaler saves only the inner optimizer's variables in
            # `.keras` files; Keras 3's also saves the scale and the records.
            own = [self.dynamic_scale, self.step_counter, *self._own_variables]
            return [*self._optimizer.variables, *own]

        def add_variable(
            self, shape, dtype=None, initializer="zeros", aggregation=None, name=None
        ):
            variable = tf.Variable(
                keras.initializers.get(initializer)(shape, dtype),
                name=name,
                trainable=False,
                aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
            )
            # Checkpoints reach the scaler through the inner optimizer (Keras
            # 2's scaler delegates its tracking there).
            self._track_trackable(variable, name, overwrite=True)
            self._own_variables.append(variable)
            return variable

        def scale_loss(self, loss):
            return loss * tf.cast(self.dynamic_scale, loss.dtype)

        def get_scaled_loss(self, loss):
            self._loss_has_been_scaled = True
            if callable(loss):
                return lambda: self.scale_loss(loss())
            return self.scale_loss(loss)

        # Keras 2's contract: `get_unscaled_gradients` (inherited) divides by
        # the scale and `apply_gradients` takes unscaled gradients, as a
        # custom loop following the tf.keras guide passes them, and applies
        # them as they are. `fit` calls `minimize`, which hands the scaled
        # ones straight to `apply`, which unscales them once. Both skip a
        # non-finite step and record it.

        def minimize(self, loss, var_list, tape=None):
            tape = tf.GradientTape() if tape is None else tape
            with tape:
                scaled_loss = self.get_scaled_loss(loss)
            grads_and_vars = self._optimizer.compute_gradients(
                scaled_loss, var_list, tape=tape
            )
            self._gradients_have_been_unscaled = True  # by `apply`
            return self._apply_scaled(grads_and_vars)

        # Read by `apply` (`_apply_step.apply_unscaled`): the gradients it
        # gets are unscaled already; it checks and records them only.
        gradients_unscaled_by_caller = False

        def apply_gradients(
            self, grads_and_vars, skip_gradients_aggregation=False, **kwargs
        ):
            keras2_scaler._maybe_warn_about_scaling(
                self._loss_has_been_scaled, self._gradients_have_been_unscaled
            )
            self.gradients_unscaled_by_caller = True
            try:
                return self._apply_scaled(
                    grads_and_vars, skip_gradients_aggregation, **kwargs
                )
            finally:
                self.gradients_unscaled_by_caller = False

        def _apply_scaled(
            self, grads_and_vars, skip_gradients_aggregation=False, **kwargs
        ):
            grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
            aggregate = kwargs.pop("experimental_aggregate_gradients", True)
            if (
                tf.distribute.has_strategy()
                and aggregate
                and not skip_gradients_aggregation
            ):
                # Every replica must see the same (possibly non-finite)
                # gradients to take the same branch.
                grads_and_vars = self._optimizer.aggregate_gradients(grads_and_vars)
            grads = [g for g, _ in grads_and_vars]
            variables = [v for _, v in grads_and_vars]
            return self.apply(grads, variables)

    return Keras2LossScaleBase


if IS_KERAS_3:
    LossScaleOptimizerBase = keras.optimizers.LossScaleOptimizer
    KerasLossScaleOptimizer = keras.optimizers.LossScaleOptimizer
else:
    LossScaleOptimizerBase = _make_keras2_loss_scale_base()
    KerasLossScaleOptimizer = (
        keras.mixed_precision.LossScaleOptimizer,
        LossScaleOptimizerBase.__mro__[1],
    )


def current_loss_scale(optimizer):
    """Return a Keras (or our) loss scaler's current scale (variable or tensor).

    Keras 3 keeps it in `dynamic_scale`; Keras 2's `LossScaleOptimizerV3`
    exposes it as `loss_scale` (our scaler has both on Keras 2).
    """
    if IS_KERAS_3:
        return optimizer.dynamic_scale
    return optimizer.loss_scale


def loss_scale_variables(optimizer):
    """Return the `(scale, growth counter)` variables of a Keras or our scaler.

    Keras 3's and ours name them `dynamic_scale` and `step_counter`. Keras 2's
    `LossScaleOptimizerV3` exposes the counter as `dynamic_counter` but the
    scale only as a tensor copy (`loss_scale`): its variable is reached in
    the private `_loss_scale` state, the one way to put the scale back
    (`AMPMonitor` after a denial).
    """
    if IS_KERAS_3 or hasattr(optimizer, "dynamic_scale"):
        return optimizer.dynamic_scale, optimizer.step_counter
    return optimizer._loss_scale.current_loss_scale, optimizer.dynamic_counter


def fixed_loss_scale(optimizer):
    """Return the scale of a Keras loss scaler that never moves, else None.

    Keras 3's `LossScaleOptimizer` is always dynamic; Keras 2's takes
    `dynamic=False` and then keeps `initial_scale` for every step.
    """
    if IS_KERAS_3 or optimizer.dynamic:
        return None
    return float(optimizer.initial_scale)


def is_compiled(model) -> bool:
    """Return whether `model.compile` ran (Keras 2 keeps it private)."""
    if IS_KERAS_3:
        return bool(getattr(model, "compiled", False))
    return bool(getattr(model, "_is_compiled", False))


def is_keras_tensor(x) -> bool:
    """Return True for a symbolic `KerasTensor` (functional model building).

    Keras 2's `is_keras_tensor` raises for values that are no tensor at all
    (NumPy arrays, lists); those are not symbolic.
    """
    try:
        return keras.backend.is_keras_tensor(x)
    except ValueError:
        return False


def count_skipped_step(optimizer) -> None:
    """Count a skipped step in `iterations` where Keras's own scaler does (Keras 2).

    Keras 2's `LossScaleOptimizerV3` adds one to the inner optimizer's
    `iterations` on a skipped step, so learning-rate schedules and Adam's
    bias correction count it; Keras 3's leaves `iterations` as it is.
    """
    if not IS_KERAS_3:
        optimizer.inner_optimizer.iterations.assign_add(1, read_value=False)


def metric_direction(metric) -> str | None:
    """Return `"up"` or `"down"` where Keras knows which way `metric` improves.

    Keras 3's metrics carry it in the private `_direction` (what Keras's own
    `EarlyStopping` and `ModelCheckpoint` read, so the one place to learn
    it). Keras 2's callbacks guess it from the name in `mode="auto"`, each
    its own way: "up" where both guess it, else None (they guess "down" for
    `precision` too, which users then monitor with `mode="max"`; a loss is
    "down" by its name, `_step_recorder._direction_of`).
    """
    if IS_KERAS_3:
        return getattr(metric, "_direction", None)
    name = metric.name
    # Keras 2.15's `ModelCheckpoint` and `EarlyStopping`, `mode="auto"`.
    up_to_checkpoint = "acc" in name or name.startswith("fmeasure")
    up_to_early_stopping = name.endswith(("acc", "accuracy", "auc"))
    return "up" if up_to_checkpoint and up_to_early_stopping else None


# Keras 2's callbacks start from the worst value and take a value for the
# best only if it beats it: never a NaN. Keras 3's take the first value they
# see, NaN included, and nothing beats a NaN after it.
NAN_IS_NEVER_THE_BEST = not IS_KERAS_3


def optimizer_built(optimizer) -> bool:
    """Return whether an optimizer created its variables.

    Keras 3 says so in `built`; Keras 2's optimizers set the private `_built`
    in their `build` (our scaler sets both).
    """
    if IS_KERAS_3:
        return optimizer.built
    return bool(
        getattr(optimizer, "built", False) or getattr(optimizer, "_built", False)
    )


def optimizer_build_scope(optimizer):
    """Return the context the scaler builds its variables in.

    Keras 3 names them under the optimizer (`keras.name_scope`); Keras 2 lifts
    variable creation out of the traced train step (`tf.init_scope`), as its
    own `apply_gradients` does.
    """
    if IS_KERAS_3:
        return keras.name_scope(optimizer.name, caller=optimizer)
    return tf.init_scope()


def apply_inner(inner_optimizer, grads, variables) -> None:
    """Let the inner optimizer apply `grads` (already unscaled) to `variables`."""
    if IS_KERAS_3:
        inner_optimizer.apply(grads, trainable_variables=variables)
    else:
        # Gradients were aggregated across replicas before the finiteness check.
        inner_optimizer.apply_gradients(
            list(zip(grads, variables, strict=True)), skip_gradients_aggregation=True
        )


def divide(gradient, scale):
    """Return `gradient / scale` (dense or `tf.IndexedSlices`).

    Keras 2 as its own scaler does it: times the reciprocal, cast to the
    gradient's dtype. A float16 gradient's scale of 65536 or more would be
    infinite in float16; its reciprocal is not.
    """
    if IS_KERAS_3:
        return keras.ops.divide(gradient, scale)
    reciprocal = 1.0 / tf.cast(scale, tf.float32)
    if isinstance(gradient, tf.IndexedSlices):
        return tf.IndexedSlices(
            gradient.values * tf.cast(reciprocal, gradient.values.dtype),
            gradient.indices,
            gradient.dense_shape,
        )
    return gradient * tf.cast(reciprocal, gradient.dtype)


def build_from_first_replica(model, strategy) -> bool:
    """Let `fit` build `model` under a multi-worker strategy (Keras 3 bug).

    Why private: before its first step `fit` (Keras 3's TF trainer,
    `_maybe_symbolic_build`) reduces the first batch with
    `strategy.reduce("MEAN", (x, y))`. With more than one worker that reduce
    takes a single tensor, not a tuple, and raises "Attempt to convert a value
    (PerReplica...) to a Tensor". The batch only gives the symbolic build its
    shapes and dtypes, so this instance override hands it the first local
    replica's batch instead; the class's own method does the rest. Returns
    False (and does nothing) on Keras 2, whose trainer is another one.
    """
    original = getattr(model, "_maybe_symbolic_build", None)
    if original is None:
        return False

    def maybe_symbolic_build(iterator=None, data_batch=None):
        if iterator is not None and data_batch is None:
            for _, _, batches in iterator:
                data_batch = tf.nest.map_structure(
                    lambda value: strategy.experimental_local_results(value)[0],
                    next(batches),
                )
                break
        return original(data_batch=data_batch)

    model._maybe_symbolic_build = maybe_symbolic_build
    return True

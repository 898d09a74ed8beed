"""Checks of the monitor's arguments and of the model it is given.

Everything that can fail on bad input fails at construction or in
`on_train_begin`, before the first step: an unwritable `log_dir`, a model
without an optimizer, an unknown or unavailable engine, op lists with a layer
engine, list entries naming no layer, a read interval the ring cannot cover.
"""

import logging
import math
import os
import weakref

import numpy as np

from keras_amp_plus import _compat
from keras_amp_plus._arguments import is_int, is_real
from keras_amp_plus._lists import layer_names
from keras_amp_plus.callbacks import _distribution as distribution
from keras_amp_plus.callbacks._allocator_check import warn_once_if_allocator_unpooled
from keras_amp_plus.callbacks._event_log import check_writable
from keras_amp_plus.callbacks._hardware_check import (
    low_precision_source,
    warn_once_if_bfloat16_is_slow,
)
from keras_amp_plus.callbacks._step_recorder import (
    SCALER_KAP,
    SCALER_KERAS,
    SCALER_NONE,
    scaler_kind,
)
from keras_amp_plus.engines import resolve_engine
from keras_amp_plus.engines._itex import require_itex
from keras_amp_plus.engines._keras_engine import (
    computes_in_16_bits,
    holds_16_bit_variables,
)
from keras_amp_plus.engines._resolve import check_engine_name

DEFAULT_CAPACITY = 64
logger = logging.getLogger("keras_amp_plus")
# Optimizers already warned of training float16 unscaled: once each, not at
# every `fit` of a loop of them.
_unscaled_warned = weakref.WeakSet()


def check_arguments(
    log_dir,
    read_every_steps,
    engine,
    trusted_backward_scale,
    evidence_decay,
    flags: dict,
    counts: dict,
) -> None:
    """Validate the monitor's constructor arguments (Keras-style errors)."""
    _check_log_dir(log_dir)
    for name, value in flags.items():
        if not isinstance(value, (bool, np.bool_)):
            raise TypeError(
                f"`{name}` must be a bool (True or False). "
                f"Received: {name}={value!r} of type {type(value).__name__}"
            )
    for name, value in counts.items():
        minimum = 1 if name == "deny_threshold" else 0
        if not is_int(value) or value < minimum:
            raise ValueError(
                f"`{name}` must be an integer >= {minimum}. Received: {name}={value!r}"
            )
    if read_every_steps is not None and (
        not is_int(read_every_steps) or read_every_steps < 1
    ):
        raise ValueError(
            "`read_every_steps` must be a positive integer or None. "
            f"Received: read_every_steps={read_every_steps!r}"
        )
    if not is_real(trusted_backward_scale) or not (
        0 < trusted_backward_scale < math.inf
    ):
        raise ValueError(
            "`trusted_backward_scale` must be a finite number > 0: the loss scale "
            "at or below which a backward overflow counts against a layer "
            f"(1.0 by default). Received: "
            f"trusted_backward_scale={trusted_backward_scale!r}"
        )
    if not is_real(evidence_decay) or not 0 <= evidence_decay < 1:
        raise ValueError(
            "`evidence_decay` must be a number in [0, 1): the factor a layer's "
            "accumulated evidence is multiplied by at each epoch end. "
            f"Received: evidence_decay={evidence_decay!r}"
        )
    check_engine_name(engine)


def _check_log_dir(log_dir) -> None:
    if log_dir is None:
        return
    if not isinstance(log_dir, (str, bytes)) and not hasattr(log_dir, "__fspath__"):
        raise TypeError(
            "`log_dir` must be a path (str or os.PathLike) or None. "
            f"Received: log_dir={log_dir!r}"
        )
    if not os.fspath(log_dir):
        raise ValueError(
            "`log_dir` must be a non-empty path, or None to log to Python "
            f"logging only. Received: log_dir={log_dir!r}"
        )


def _qualified_name(obj) -> str:
    return f"{type(obj).__module__}.{type(obj).__name__}"


def _described_optimizer(optimizer) -> str:
    """Name the user's optimizer, also inside the loss scaler Keras wrapped it in."""
    inner = getattr(optimizer, "inner_optimizer", None)
    if inner is None:
        return _qualified_name(optimizer)
    return f"{_qualified_name(inner)} (wrapped in {type(optimizer).__name__})"


def check_model(model) -> None:
    """Raise unless `model` was compiled with an optimizer and is built."""
    if getattr(model, "optimizer", None) is None:
        raise ValueError(
            "AMPMonitor needs a model compiled with an optimizer: it reads the "
            "loss scale and overflow records from it. Call `model.compile("
            "optimizer=..., loss=...)` first. Received: optimizer=None"
        )
    if _compat.is_legacy_optimizer(model.optimizer):
        raise ValueError(
            "AMPMonitor reads the loss scale and overflow records of a current "
            f"Keras optimizer: {_compat.LEGACY_OPTIMIZER_ADVICE} (Keras wraps it "
            "in its loss scaler under mixed_float16 by itself). Received: "
            f"optimizer={_described_optimizer(model.optimizer)}"
        )
    check_scaled_once(model.optimizer)
    if not model.built:
        # A subclassed model (or a Sequential without an `Input`) creates its
        # variables in the first step; the monitor builds the optimizer's
        # state for them before that step, as Keras's BackupAndRestore does,
        # and an optimizer built for no variables fails at the first update.
        raise ValueError(
            "AMPMonitor needs a built model: it builds the optimizer (and the "
            "loss scaler's state) for the model's variables before the first "
            "step, and this model has not created its variables yet. Build it "
            "before `fit()` by calling it on a batch of data (`model(x[:1])`) or with "
            f"`model.build(input_shape)`. Received: model={model.name!r} with "
            "built=False"
        )


def check_scaled_once(optimizer) -> None:
    """Raise when a loss scale optimizer wraps another one.

    Keras's `LossScaleOptimizer` accepts one as its inner optimizer (ours
    refuses it): the outer one scales the loss, both unscale the gradients,
    and every update comes out the inner scale times too small, silently.
    """
    inner = getattr(optimizer, "inner_optimizer", None)
    scaler = _compat.KerasLossScaleOptimizer
    if isinstance(optimizer, scaler) and isinstance(inner, scaler):
        raise ValueError(
            "AMPMonitor found a loss scale optimizer wrapping another one: the "
            "outer one scales the loss, both unscale the gradients, so every "
            "update would be the inner loss scale times too small. Wrap the "
            "plain optimizer once, e.g. `keras_amp_plus.optimizers."
            "LossScaleOptimizer(keras.optimizers.Adam())`. Received: "
            f"optimizer={type(optimizer).__name__} wrapping "
            f"{type(inner).__name__} wrapping "
            f"{type(inner.inner_optimizer).__name__}"
        )


def engine_for_fit(monitor, model):
    """Return the Engine the monitor's `engine` argument stands for in this `fit`.

    Resolved again at every `fit` ("auto" depends on the model and the
    lists, which may have changed since the last); the Engine of the last
    `fit` when it is of the same kind, so its rebuilt step is reused.
    """
    requested = monitor.requested_engine
    engine = resolve_engine(requested, model, monitor.lists)
    previous = monitor.engine
    if isinstance(requested, str) and type(previous) is type(engine):
        return previous
    return engine


def check_fit_setup(monitor, model):
    """Check the model, log_dir, engine and lists; return the resolved engine."""
    check_model(model)
    distribution.check_strategy(model)
    distribution.check_jit_compile(model)
    if monitor.log_dir and distribution.is_chief(model.distribute_strategy):
        check_writable(monitor.log_dir)  # other workers write nothing there
    engine = engine_for_fit(monitor, model)
    if engine.name == "itex":
        require_itex()  # fail now, not at the first list change
    # Fail now, not mid-fit: grappler with oneDNN off, ITEX whose bfloat16
    # kernels would abort the process.
    engine.check_available(model)
    engine.check_lists(monitor.lists)
    monitor.lists.matching_layers(model)
    warn_once_if_bfloat16_is_slow(model, engine)
    warn_once_if_allocator_unpooled()
    warn_if_float16_is_unscaled(model, engine)
    if monitor.adapt:
        warn_if_policies_are_out_of_reach(model, engine)
    return engine


POLICIES_OUT_OF_REACH = (
    "AMPMonitor: engine=%r moves op types between lists, but %d layer(s) "
    "compute in 16 bits under their Keras dtype policy (%s), which op lists "
    "cannot change: denying such a layer would leave it in 16 bits. Use "
    "engine='keras' (what 'auto' picks for a model with a mixed policy), or "
    "train the model in float32 and let the engine's rewrite lower precision."
)


VARIABLES_OUT_OF_REACH = (
    "AMPMonitor: %d layer(s) keep their variables in 16 bits under a pure "
    "dtype policy (%s): Keras has no policy computing such a layer in float32, "
    "so the monitor cannot deny it (it names it and leaves it in 16 bits). "
    "Train under 'mixed_float16' or 'mixed_bfloat16' (float32 variables) to "
    "let the monitor move layers to float32."
)


def policy_out_of_reach(layer, engine) -> bool:
    """Return True when `engine` cannot move `layer` to float32.

    Graph engines rewrite float32 ops; a layer whose Keras dtype policy
    computes in 16 bits does so whatever their op lists say. The layer
    engine cannot move a layer with 16-bit variables (`KerasEngine.apply`).
    """
    if engine.level == "op":
        return computes_in_16_bits(layer.dtype_policy)
    return holds_16_bit_variables(layer)


def warn_if_policies_are_out_of_reach(model, engine) -> None:
    """Log a warning when the engine could not deny some of the model's layers."""
    layers = [
        layer
        for layer in layer_names.candidate_layers(model)
        if policy_out_of_reach(layer, engine)
    ]
    if not layers:
        return
    names = ", ".join(repr(layer.name) for layer in layers[:5])
    names += f" and {len(layers) - 5} more" if len(layers) > 5 else ""
    if engine.level == "op":
        logger.warning(POLICIES_OUT_OF_REACH, engine.name, len(layers), names)
    else:
        logger.warning(VARIABLES_OUT_OF_REACH, len(layers), names)


def warn_if_float16_is_unscaled(model, engine=None) -> None:
    """Log a warning when float16 layers train without a loss scale above 1.

    float16 flushes gradients below about 6e-8 to zero: without a scale that
    lifts them (no scaler, `LossScaleOptimizer.guard()`, made for bfloat16,
    or Keras 2's `dynamic=False` scaler at a scale of 1 or less), small
    gradients are lost without a sign. Given once per optimizer.

    Args:
        model: the Keras model about to be trained.
        engine: the resolved engine. Defaults to None. ITEX's FLOAT16 rewrite
            computes in float16 under a float32 policy.
    """
    optimizer = model.optimizer
    if optimizer in _unscaled_warned:
        return
    source = low_precision_source(model, "float16", engine)
    if source is None:
        return
    unscaled = _unmoving_scale(optimizer)
    if unscaled is None:
        return
    _unscaled_warned.add(optimizer)
    found, remedy = unscaled
    logger.warning(
        "AMPMonitor: model %r computes in float16 (%s) with %s: gradients "
        "below float16's smallest value (about 6e-8) become zero. %s",
        model.name,
        source,
        found,
        remedy,
    )


_DYNAMIC = "`keras_amp_plus.optimizers.LossScaleOptimizer(optimizer)`"


def _unmoving_scale(optimizer):
    """Return `(what, remedy)` where `optimizer` leaves float16 unscaled, else None."""
    kind = scaler_kind(optimizer)
    if kind == SCALER_NONE:
        return (
            f"optimizer {type(optimizer).__name__} without a loss scaler",
            f"Wrap the optimizer in {_DYNAMIC} (dynamic scaling).",
        )
    if kind == SCALER_KAP and optimizer.max_scale <= 1:
        return (
            f"a loss scale of at most {optimizer.max_scale:g} (max_scale)",
            f"Wrap its inner optimizer in {_DYNAMIC} with the default scales "
            "(dynamic scaling); `LossScaleOptimizer.guard()` is made for bfloat16.",
        )
    if kind == SCALER_KERAS:
        fixed = _compat.fixed_loss_scale(optimizer)
        if fixed is not None and fixed <= 1:
            return (
                f"Keras's fixed loss scale of {fixed:g} (dynamic=False)",
                f"Wrap its inner optimizer in {_DYNAMIC} instead (dynamic "
                "scaling, every overflow recorded), or pass `dynamic=True`.",
            )
    return None


def check_read_interval(read_every: int, steps_per_execution: int, capacity: int):
    """Raise unless every event can be read before the ring overwrites it."""
    for name, value in (
        ("read_every_steps", read_every),
        ("steps_per_execution", steps_per_execution),
    ):
        if value > capacity:
            raise ValueError(
                f"`{name}` must not exceed the event ring's capacity "
                f"({capacity}), or events could be overwritten before they are "
                "read. Lower it or raise the LossScaleOptimizer's "
                f"`event_buffer_size`. Received: {name}={value}"
            )

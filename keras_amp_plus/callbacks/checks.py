"""Checks of the monitor's arguments and of the model it is given.

Everything that can fail on bad input fails at construction or in
`on_train_begin`, before the first step: an unwritable `log_dir`, a model
without an optimizer, an unknown or unavailable engine, op lists with a layer
engine, list entries naming no layer, a read interval the ring cannot cover.
"""

from keras_amp_plus.callbacks.event_log import check_writable
from keras_amp_plus.engines import resolve_engine
from keras_amp_plus.engines.itex import require_itex
from keras_amp_plus.policy import OP_FIELDS, PrecisionLists

DEFAULT_CAPACITY = 64


def check_arguments(log_dir, read_every_steps, **counts) -> None:
    """Validate the monitor's constructor arguments (Keras-style errors)."""
    if (
        log_dir is not None
        and not isinstance(log_dir, (str, bytes))
        and (not hasattr(log_dir, "__fspath__"))
    ):
        raise TypeError(
            "`log_dir` must be a path (str or os.PathLike) or None. "
            f"Received: log_dir={log_dir!r}"
        )
    for name, value in counts.items():
        minimum = 1 if name == "deny_threshold" else 0
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ValueError(
                f"`{name}` must be an integer >= {minimum}. Received: {name}={value!r}"
            )
    if read_every_steps is not None and (
        not isinstance(read_every_steps, int) or read_every_steps < 1
    ):
        raise ValueError(
            "`read_every_steps` must be a positive integer or None. "
            f"Received: read_every_steps={read_every_steps!r}"
        )


def as_lists(lists) -> PrecisionLists:
    """Accept PrecisionLists, its config dict, or None."""
    if lists is None:
        return PrecisionLists()
    if isinstance(lists, PrecisionLists):
        return lists
    if isinstance(lists, dict):
        return PrecisionLists.from_config(lists)
    raise TypeError(
        "`lists` must be a `keras_amp_plus.PrecisionLists`, its config dict, or "
        f"None. Received: lists={lists!r}"
    )


def check_model(model) -> None:
    """Raise unless `model` was compiled with an optimizer."""
    if getattr(model, "optimizer", None) is None:
        raise ValueError(
            "AMPMonitor needs a model compiled with an optimizer: it reads the "
            "loss scale and overflow records from it. Call `model.compile("
            "optimizer=..., loss=...)` first. Received: optimizer=None"
        )


def check_fit_setup(monitor, model):
    """Check the model, log_dir, engine and lists; return the resolved engine."""
    check_model(model)
    if monitor.log_dir:
        check_writable(monitor.log_dir)
    engine = resolve_engine(monitor.engine, model)
    if engine.name == "itex":
        # Fail now (no ITEX, or bfloat16 kernels that abort), not mid-fit.
        getattr(engine, "check_ready", require_itex)()
    if engine.level == "layer":
        ops = {f: getattr(monitor.lists, f) for f in OP_FIELDS}
        if any(ops.values()):
            raise ValueError(
                f"Engine {engine.name!r} works on layers, but `lists` holds op "
                "types. Use engine='grappler' (or 'itex') for op lists, or name "
                f"layers instead. Received: {ops}"
            )
    monitor.lists.matching_layers(model)
    return engine


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

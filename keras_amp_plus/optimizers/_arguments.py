"""Checks on the arguments of `LossScaleOptimizer`, raised before anything is built.

Every check runs before Keras's constructor touches the inner optimizer (Keras
clears the inner optimizer's `loss_scale_factor`), so a bad argument changes
nothing.
"""

import math

import keras
import numpy as np

from keras_amp_plus import _compat
from keras_amp_plus._arguments import is_int, is_real

ON_MIN_SCALE_MODES = ("raise", "warn", "ignore")


def check_inner_optimizer(inner_optimizer) -> None:
    """Raise TypeError unless `inner_optimizer` is a plain Keras optimizer."""
    if isinstance(inner_optimizer, _compat.KerasLossScaleOptimizer):
        raise TypeError(
            "`inner_optimizer` is already a LossScaleOptimizer; wrapping it again "
            "would scale the loss twice. Pass the optimizer it wraps instead "
            f"(`inner_optimizer.inner_optimizer`). Received: "
            f"inner_optimizer={inner_optimizer!r}"
        )
    if not isinstance(inner_optimizer, keras.optimizers.Optimizer):
        legacy = _compat.is_legacy_optimizer(inner_optimizer)
        raise TypeError(
            "`inner_optimizer` must be a `keras.optimizers.Optimizer` instance, "
            "e.g. `keras.optimizers.Adam()`"
            + (f" ({_compat.LEGACY_OPTIMIZER_ADVICE})" if legacy else "")
            + ". Received: "
            f"inner_optimizer={inner_optimizer!r} of type "
            f"{type(inner_optimizer).__name__}"
        )


# The largest event ring: each slot holds a mask of every tracked variable,
# so a ring this long of a model with 1000 variables takes 64 MiB.
MAX_EVENT_BUFFER_SIZE = 2**16

# An example value of each number, for the messages.
_EXAMPLES = {
    "initial_scale": "2.0**15",
    "min_scale": "1.0",
    "max_scale": "2.0**24",
}


def _require_number(name: str, value) -> None:
    """Raise TypeError unless `value` is a real number (not a bool)."""
    if not is_real(value):
        raise TypeError(
            f"`{name}` must be a number. Received: {name}={value!r} of type "
            f"{type(value).__name__}"
        )


def _check_positive_int(name: str, value) -> None:
    _require_number(name, value)
    if not is_int(value) or value < 1:
        raise ValueError(
            f"`{name}` must be an integer >= 1. Received: {name}={value!r}"
        )


def _check_finite_real(name: str, value) -> None:
    _require_number(name, value)
    if not math.isfinite(value):
        raise ValueError(
            f"`{name}` must be a finite number. Received: {name}={value!r}"
        )


def check_scale_bounds(initial_scale, min_scale, max_scale) -> None:
    """Raise ValueError unless 0 < min_scale <= initial_scale <= max_scale."""
    for name, value in (
        ("initial_scale", initial_scale),
        ("min_scale", min_scale),
        ("max_scale", max_scale),
    ):
        _check_finite_real(name, value)
    if min_scale <= 0:
        raise ValueError(
            "`min_scale` must be positive: a zero scale turns every gradient "
            "into 0/0 = NaN. Use e.g. `min_scale=1.0`. "
            f"Received: min_scale={min_scale!r}"
        )
    # The scale is a float32 variable: bounds beyond its normal range would
    # round to 0 (every gradient 0/0) or to inf (no ceiling at all).
    lowest, highest = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)
    for name, value in (
        ("initial_scale", initial_scale),
        ("min_scale", min_scale),
        ("max_scale", max_scale),
    ):
        if not lowest <= value <= highest:
            raise ValueError(
                f"`{name}` must lie in float32's normal range [{lowest:.3g}, "
                f"{highest:.3g}]: the loss scale is a float32 variable, where "
                "a smaller value rounds to 0 and a larger one to inf. Use e.g. "
                f"`{name}={_EXAMPLES[name]}`. Received: {name}={value!r}"
            )
    if min_scale > max_scale:
        raise ValueError(
            "`min_scale` must not be greater than `max_scale`. Lower `min_scale` "
            "or raise `max_scale` (equal values fix the scale). Received: "
            f"min_scale={min_scale!r}, max_scale={max_scale!r}"
        )
    if not min_scale <= initial_scale <= max_scale:
        raise ValueError(
            "`initial_scale` must lie in [min_scale, max_scale]. Pass an "
            "`initial_scale` in that range or widen the bounds. Received: "
            f"initial_scale={initial_scale!r}, min_scale={min_scale!r}, "
            f"max_scale={max_scale!r}"
        )


def check_schedule(growth_factor, backoff_factor, dynamic_growth_steps, hysteresis):
    """Raise ValueError unless the growth/backoff schedule is well formed."""
    _check_finite_real("growth_factor", growth_factor)
    if growth_factor < 1:
        raise ValueError(
            "`growth_factor` must be >= 1 (1 disables growth); a smaller value "
            "would shrink the scale after finite steps. "
            f"Received: growth_factor={growth_factor!r}"
        )
    _check_finite_real("backoff_factor", backoff_factor)
    if not 0 < backoff_factor < 1:
        raise ValueError(
            "`backoff_factor` must lie strictly between 0 and 1, e.g. 0.5. "
            f"Received: backoff_factor={backoff_factor!r}"
        )
    _check_positive_int("dynamic_growth_steps", dynamic_growth_steps)
    _check_positive_int("hysteresis", hysteresis)


def check_on_min_scale(on_min_scale) -> None:
    """Raise ValueError unless `on_min_scale` is one of the known modes."""
    if on_min_scale not in ON_MIN_SCALE_MODES:
        raise ValueError(
            f"`on_min_scale` must be one of {ON_MIN_SCALE_MODES}. "
            f"Received: on_min_scale={on_min_scale!r}"
        )


def check_event_buffer_size(event_buffer_size) -> None:
    """Raise unless the event ring has 1 to `MAX_EVENT_BUFFER_SIZE` slots."""
    _check_positive_int("event_buffer_size", event_buffer_size)
    if event_buffer_size > MAX_EVENT_BUFFER_SIZE:
        raise ValueError(
            f"`event_buffer_size` must be at most {MAX_EVENT_BUFFER_SIZE}: each "
            "slot holds a mask of every variable, in memory the whole run. Read "
            "the events more often (AMPMonitor reads them every "
            "`read_every_steps`) rather than keeping more. "
            f"Received: event_buffer_size={event_buffer_size!r}"
        )

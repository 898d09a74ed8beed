"""The loss-scale state machine: growth, backoff with hysteresis, the floor.

Runs inside the compiled train step. Growth and backoff are written with
`tf.where` rather than `tf.cond`: a few scalar ops are cheaper than a branch.
"""

import functools
import warnings

import tensorflow as tf

from keras_amp_plus import _compat

_FLOOR_ADVICE = (
    "The loss scale cannot back off any further, so steps like this one will "
    "keep being skipped. If every gradient was non-finite, the loss itself was "
    "Inf/NaN (a forward overflow: a layer's output exceeded float16's range, "
    "whatever the scale): keep that layer in float32 (the AMPMonitor callback "
    "finds and denies it) or use the `mixed_bfloat16` policy, which has "
    "float32's exponent range; a lower learning rate does not help. If only "
    "some gradients overflowed (a backward overflow), try a lower learning rate "
    "or gradient clipping on the inner optimizer, keep the layers of "
    "`optimizer.overflow_summary()['by_variable']` in float32, or lower "
    "`min_scale`."
)
_RAISE_TEMPLATE = (
    "LossScaleOptimizer: gradients overflowed at step {} while the loss scale "
    "was already at its floor (loss scale {}, min_scale={}). "
    + _FLOOR_ADVICE
    + " Pass on_min_scale='warn' or 'ignore' to keep training anyway."
)


def _scale_is_fixed(optimizer) -> bool:
    return optimizer.min_scale == optimizer.max_scale


def after_finite_step(optimizer) -> None:
    """Count a finite step; grow the scale after `dynamic_growth_steps` of them."""
    if _scale_is_fixed(optimizer):
        return
    counter = tf.convert_to_tensor(optimizer.step_counter)
    scale = tf.convert_to_tensor(optimizer.dynamic_scale)
    ready = counter >= optimizer.dynamic_growth_steps - 1
    grown = tf.minimum(scale * optimizer.growth_factor, optimizer.max_scale)
    optimizer.dynamic_scale.assign(tf.where(ready, grown, scale))
    optimizer.step_counter.assign(tf.where(ready, tf.zeros_like(counter), counter + 1))
    if optimizer.hysteresis > 1:
        since = tf.convert_to_tensor(optimizer.overflows_since_scale_change)
        optimizer.overflows_since_scale_change.assign(
            tf.where(ready, tf.zeros_like(since), since)
        )


def after_skipped_step(optimizer, scale_before):
    """Back off on the `hysteresis`-th overflow since the last scale change.

    Returns:
        The float32 scale after this step.
    """
    since = optimizer.overflows_since_scale_change + 1
    back_off = since >= optimizer.hysteresis
    backed_off = tf.maximum(
        scale_before * optimizer.backoff_factor, optimizer.min_scale
    )
    scale_after = tf.where(back_off, backed_off, scale_before)
    optimizer.dynamic_scale.assign(scale_after)
    optimizer.step_counter.assign(tf.zeros_like(optimizer.step_counter))
    optimizer.overflows_since_scale_change.assign(
        tf.where(back_off, tf.zeros_like(since), since)
    )
    return scale_after


def act_at_floor(optimizer, step, scale_before) -> None:
    """Record an overflow that hit a scale already at its floor; apply `on_min_scale`.

    "raise" fails the step with `tf.errors.InvalidArgumentError` carrying the
    message; "warn" calls back to Python only on that rare event, once per
    optimizer; "ignore" only records. XLA cannot compile either callback, so
    inside a `jit_compile=True` step the action waits for the host: the next
    `overflow_summary()`, `read_events()` or `check_min_scale()` call.
    """
    at_floor = scale_before <= optimizer.min_scale
    hits = tf.cast(at_floor, tf.int64)
    optimizer.min_scale_overflow_count.assign_add(hits)
    last = optimizer.last_min_scale_overflow_step
    optimizer.last_min_scale_overflow_step.assign(tf.where(at_floor, step, last))
    mode = optimizer.on_min_scale
    if mode == "ignore":
        return
    if _compat.in_xla_compiled_function():
        _defer_to_host(optimizer)
        return
    if mode == "raise":
        message = tf.strings.format(
            _RAISE_TEMPLATE, (step, scale_before, optimizer.min_scale)
        )
        tf.debugging.Assert(tf.logical_not(at_floor), [message])
        return
    warn = functools.partial(_warn_once, optimizer)
    tf.cond(
        at_floor,
        lambda: tf.py_function(warn, [step, scale_before], Tout=tf.bool),
        lambda: tf.constant(False),
    )


def read_each_epoch(optimizer, reading: bool) -> None:
    """Say whether a callback reads `optimizer`'s records every epoch.

    `AMPMonitor` does, from `on_train_begin` to `on_train_end`: an
    XLA-compiled step's floor overflows are then acted on at each epoch's
    end, and "warn" (the default) needs no warning that the action waits.

    Args:
        optimizer: a `keras_amp_plus.optimizers.LossScaleOptimizer`.
        reading: True while such a callback runs.
    """
    optimizer._read_each_epoch = bool(reading)


def _defer_to_host(optimizer):
    optimizer._min_scale_action_on_host = True
    if optimizer._deferral_said:
        return
    if optimizer.on_min_scale == "warn" and optimizer._read_each_epoch:
        return  # the epoch's read warns, if the floor is ever hit
    optimizer._deferral_said = True
    warnings.warn(
        f"LossScaleOptimizer: on_min_scale={optimizer.on_min_scale!r} cannot "
        "act inside an XLA-compiled train step (jit_compile=True). Overflows "
        "at the floor are counted in `min_scale_overflow_count` and acted on "
        "at the next `overflow_summary()`, `read_events()` or "
        "`check_min_scale()` call (AMPMonitor reads them every epoch).",
        UserWarning,
        stacklevel=2,
    )


def check_min_scale_on_host(optimizer) -> None:
    """Apply `on_min_scale` for floor overflows counted by an XLA-compiled step."""
    if not optimizer._min_scale_action_on_host:
        return
    count = int(optimizer.min_scale_overflow_count.numpy())
    if count <= optimizer._min_scale_overflows_seen:
        return
    optimizer._min_scale_overflows_seen = count
    step = int(optimizer.last_min_scale_overflow_step.numpy())
    scale = float(optimizer.dynamic_scale.numpy())
    if optimizer.on_min_scale == "raise":
        raise RuntimeError(
            _RAISE_TEMPLATE.format(step, scale, optimizer.min_scale)
            + f" ({count} overflow(s) at the floor so far.)"
        )
    _warn_once(optimizer, step, scale)


def _warn_once(optimizer, step, scale_before):
    if optimizer._warned_at_min_scale:
        return False
    optimizer._warned_at_min_scale = True
    warnings.warn(
        "LossScaleOptimizer: gradients overflowed at step "
        f"{int(step)} while the loss scale was already at its floor (loss "
        f"scale {float(scale_before)}, min_scale={optimizer.min_scale}). "
        + _FLOOR_ADVICE
        + " This warning is shown once; pass on_min_scale='raise' to stop "
        "training instead.",
        UserWarning,
        stacklevel=1,
    )
    return True

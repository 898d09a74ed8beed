"""One scaler step: decide "finite or skipped" once, then apply or record.

One finite flag per gradient (`_finite_flags`) is all a scaler needs anyway;
the flags are kept as a vector, so the same reductions give both the skip
decision and the per-variable attribution. NaN-vs-Inf is only looked at on
skipped steps.

Three ways to run, like Keras's own scaler:
- no strategy: decide and update in place;
- a strategy that needs `merge_call` (MirroredStrategy and
  MultiWorkerMirroredStrategy on CPUs): finiteness is computed per replica,
  summed over every replica of every worker with the strategy, and the state
  is updated once in cross-replica context;
- a strategy that runs without `merge_call`: the per-variable flags are
  all-reduced so every replica takes the same branch.
"""

import warnings

import tensorflow as tf

from keras_amp_plus import _compat
from keras_amp_plus.optimizers import (
    _compiled_update,
    _overflow_records,
    _scale_schedule,
)
from keras_amp_plus.optimizers._finite_flags import any_nan, finite_flags


def in_guard_mode(optimizer) -> bool:
    """Return whether the scale is fixed at 1 (`LossScaleOptimizer.guard`)."""
    return optimizer.min_scale == optimizer.max_scale == 1.0


def apply_unscaled(optimizer, grads, trainable_variables):
    """Unscale the gradients and let the inner optimizer apply them.

    Not where they come unscaled already: in guard mode (dividing by 1 is a
    wasted pass) and from Keras 2's `apply_gradients`, whose contract takes
    unscaled gradients.
    """
    if in_guard_mode(optimizer) or getattr(
        optimizer, "gradients_unscaled_by_caller", False
    ):
        unscaled = list(grads)
    else:
        variables = trainable_variables or optimizer._tracked.variables
        scale = tf.convert_to_tensor(optimizer.dynamic_scale)
        unscaled = [
            g
            if g is None or getattr(v, "overwrite_with_gradient", False)
            else _compat.divide(g, scale)
            for g, v in zip(grads, variables, strict=True)
        ]
    _compat.apply_inner(optimizer.inner_optimizer, unscaled, trainable_variables)


def _finish_step(optimizer, flags, apply_fn, has_nan_fn, loss_state):
    """Count the step, then apply it or skip it and record the overflow."""
    num_tracked = len(optimizer._tracked.variables)
    finite = tf.reduce_all(flags)
    step = optimizer.total_steps + 1
    optimizer.total_steps.assign(step)
    optimizer.last_step_skipped.assign(tf.cast(tf.logical_not(finite), tf.int64))

    def apply_branch():
        apply_fn()
        _scale_schedule.after_finite_step(optimizer)

    def skip_branch():
        scale_before = tf.convert_to_tensor(optimizer.dynamic_scale)
        scale_after = _scale_schedule.after_skipped_step(optimizer, scale_before)
        nonfinite = tf.logical_not(flags[:num_tracked])
        _overflow_records.record_skipped_step(
            optimizer,
            step,
            nonfinite,
            has_nan_fn(),
            scale_before,
            scale_after,
            loss_state,
        )
        _scale_schedule.act_at_floor(optimizer, step, scale_before)
        _compat.count_skipped_step(optimizer)

    tf.cond(finite, apply_branch, skip_branch)


def _apply_with_merge_call(
    optimizer, grads, trainable_variables, positions, loss_state
):
    """Decide and update once, in cross-replica context (MirroredStrategy on CPUs)."""
    num_tracked = len(optimizer._tracked.variables)

    def cross_replica_step(distribution, grads, trainable_variables, loss_state):
        def count_over_replicas(fn):
            # Summed over every replica of every worker (a collective under
            # MultiWorkerMirroredStrategy): each worker takes the same branch,
            # or the next all-reduce of the gradients waits forever.
            per_replica = _compat.call_for_each_replica(
                distribution, lambda g: tf.cast(fn(g), tf.int32), (grads,)
            )
            return distribution.reduce(
                tf.distribute.ReduceOp.SUM, per_replica, axis=None
            )

        def nonfinite_fn(replica_grads):
            return tf.logical_not(finite_flags(replica_grads, positions, num_tracked))

        def apply_fn():
            _compat.call_for_each_replica(
                distribution,
                lambda g, v: apply_unscaled(optimizer, g, v),
                (grads, trainable_variables),
            )

        def step_counts(replica_grads, replica_loss_state):
            return tf.concat(
                [
                    tf.cast(nonfinite_fn(replica_grads), tf.int32),
                    _loss_state_counts(replica_loss_state),
                ],
                axis=0,
            )

        # One collective per step: non-finite counts per gradient (a gradient
        # is finite only if it is finite on every replica) and the loss-state
        # counts (every worker records the largest code of any replica).
        summed = distribution.reduce(
            tf.distribute.ReduceOp.SUM,
            _compat.call_for_each_replica(
                distribution, step_counts, (grads, loss_state)
            ),
            axis=None,
        )
        _finish_step(
            optimizer,
            tf.equal(summed[:-_LOSS_STATES], 0),
            apply_fn,
            lambda: count_over_replicas(any_nan) > 0,
            _largest_loss_state(summed[-_LOSS_STATES:]),
        )

    tf.distribute.get_replica_context().merge_call(
        cross_replica_step, args=(grads, trainable_variables, loss_state)
    )


# Loss-state codes are 0, 1 and 2 (`_overflow_record.LOSS_*`). `ReduceOp` has
# no MAX, so replicas agree on the largest code by summing one-hot counts.
_LOSS_STATES = 3


def _loss_state_counts(state):
    """One-hot int32 of a replica's loss-state code, to be summed."""
    return tf.one_hot(tf.cast(state, tf.int32), _LOSS_STATES, dtype=tf.int32)


def _largest_loss_state(counts):
    """Return the largest code that any replica reported, as int64."""
    codes = tf.range(_LOSS_STATES, dtype=tf.int64)
    return tf.reduce_max(tf.where(counts > 0, codes, tf.zeros_like(codes)))


def _apply_in_replica_context(
    optimizer, grads, trainable_variables, positions, loss_state
):
    """Decide and update in place (no strategy, or one without `merge_call`)."""
    flags = finite_flags(grads, positions, len(optimizer._tracked.variables))
    has_nan_fn = lambda: any_nan(grads)  # noqa: E731 - evaluated in the skip branch
    if tf.distribute.has_strategy():
        # Replicas see different local gradients and losses: agree on one
        # decision, one NaN flag and one loss state, in one all-reduce.
        packed = tf.concat(
            [
                tf.cast(tf.logical_not(flags), tf.int32),
                [tf.cast(any_nan(grads), tf.int32)],
                _loss_state_counts(loss_state),
            ],
            axis=0,
        )
        summed = tf.distribute.get_replica_context().all_reduce(
            tf.distribute.ReduceOp.SUM, packed
        )
        flags = tf.equal(summed[: -1 - _LOSS_STATES], 0)
        has_nan_fn = lambda: summed[-1 - _LOSS_STATES] > 0  # noqa: E731
        loss_state = _largest_loss_state(summed[-_LOSS_STATES:])
    _finish_step(
        optimizer,
        flags,
        lambda: _apply_unscaled_fused(optimizer, grads, trainable_variables),
        has_nan_fn,
        loss_state,
    )


def _apply_unscaled_fused(optimizer, grads, trainable_variables):
    """`apply_unscaled`, compiled with XLA where it can be (see `_compiled_update`)."""
    variables = trainable_variables or optimizer._tracked.variables
    if not _compiled_update.can_compile_update(variables):
        apply_unscaled(optimizer, grads, trainable_variables)
        return
    optimizer._compiled_updates.run(
        lambda g, v: apply_unscaled(optimizer, g, v), grads, trainable_variables
    )


def _check_not_xla_over_replicas() -> None:
    """Raise while tracing an XLA step that cannot run under this strategy.

    Keras's `compile(jit_compile=True)` compiles `strategy.run` over every
    replica as one XLA computation on one device: with several replicas in
    one process it cannot reach the other devices' variables; across workers
    on CPUs TensorFlow's XLA has no collectives. Either way the step would
    fail when first run; this raises at trace time, before any update.
    """
    if not tf.distribute.has_strategy() or not _compat.in_xla_compiled_function():
        return
    strategy = tf.distribute.get_strategy()
    devices = list(strategy.extended.worker_devices)
    if len(devices) > 1:
        why = (
            f"{len(devices)} replicas in one process are compiled into one XLA "
            "computation on one device, which cannot reach the other devices' "
            "variables"
        )
    elif strategy.num_replicas_in_sync > len(devices) and all(
        "CPU" in device.upper() for device in devices
    ):
        why = "TensorFlow's XLA has no collectives across workers on CPUs"
    else:
        return
    raise ValueError(
        f"LossScaleOptimizer cannot train in a `jit_compile=True` step here: "
        f"{why}. {_compat.JIT_COMPILE_OFF_ADVICE}. Received: "
        f"jit_compile=True, devices={devices}"
    )


LOSS_NOT_SCALED = (
    "`LossScaleOptimizer.apply()` received gradients, and no loss has gone "
    "through `optimizer.scale_loss(loss)` yet. `apply` divides every gradient "
    "by the loss scale ({scale:g} at the start), so gradients of the unscaled loss "
    "update the weights that many times too little, without any other sign. "
    "In a custom `train_step` or training loop, differentiate "
    "`scaled_loss = self.optimizer.scale_loss(loss)` (inside the tape), as "
    "Keras's own train step does. Received: gradients of a loss "
    "`scale_loss` never saw"
)


def _warn_once_unscaled_loss(optimizer) -> None:
    """Warn (once per optimizer) that `apply` may get gradients of an unscaled loss.

    Decided where the step is traced (or run eagerly), so it costs no step
    time. Not where the gradients are not divided: in guard mode, and from
    Keras 2's `apply_gradients`, whose contract takes unscaled gradients.
    """
    if in_guard_mode(optimizer):
        return
    if getattr(optimizer, "gradients_unscaled_by_caller", False):
        return
    if getattr(optimizer, "_unscaled_loss_said", False):
        return
    optimizer._unscaled_loss_said = True
    # Its first trace builds the scale variable: its value is not readable yet.
    scale = optimizer.initial_scale
    warnings.warn(LOSS_NOT_SCALED.format(scale=scale), UserWarning, stacklevel=4)


def apply_step(optimizer, grads, trainable_variables=None) -> None:
    """Run one scaler step from replica context (what `apply()` is called in)."""
    if tf.distribute.in_cross_replica_context():
        raise ValueError(
            "`LossScaleOptimizer.apply()` must be called in a replica context: "
            "inside `strategy.run(...)` (as Keras's `fit` does), not in the "
            "strategy's cross-replica scope. Call it from the replica function. "
            "Received: a call in cross-replica context"
        )
    _check_not_xla_over_replicas()
    grads = list(grads)
    if not grads:
        return  # as Keras's optimizers: nothing to apply, no step counted
    variables = (
        optimizer._tracked.variables
        if trainable_variables is None
        else list(trainable_variables)
    )
    if len(grads) != len(variables):
        whose = "the optimizer tracks" if trainable_variables is None else "passed"
        raise ValueError(
            "`LossScaleOptimizer.apply()` takes one gradient per variable, "
            f"and got {len(grads)} for the {len(variables)} variables {whose}. "
            "Pass `trainable_variables` with the gradients, in the same order. "
            f"Received: {len(grads)} gradients, {len(variables)} variables"
        )
    positions = optimizer._tracked.positions(variables)
    if not optimizer._loss_watch.ever_watched:
        # Never seen, in any function: a loop that scales in one function and
        # applies in another (or eagerly) is not told it did not scale.
        _warn_once_unscaled_loss(optimizer)
    # Finite, non-finite or not seen (a custom step that never scaled it);
    # the codes are ordered so that the largest over replicas is the answer.
    loss_state = optimizer._loss_watch.take()
    if tf.distribute.has_strategy() and not _compat.strategy_supports_no_merge_call():
        _apply_with_merge_call(
            optimizer, grads, trainable_variables, positions, loss_state
        )
    else:
        _apply_in_replica_context(
            optimizer, grads, trainable_variables, positions, loss_state
        )

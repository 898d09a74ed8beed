"""The overflow record: optimizer variables written in the step, read on the host.

All records are optimizer variables, so checkpoints, `.keras` files and
`BackupAndRestore` save them with the scaler. They use ONLY_FIRST_REPLICA
aggregation and are updated once per step (in cross-replica context under a
`merge_call` strategy), so an overflow step counts once however many replicas
there are, and a later multi-worker reduction has one well-defined value.
"""

import collections
import numbers
import threading
import warnings

import numpy as np
import tensorflow as tf

from keras_amp_plus import _compat
from keras_amp_plus.optimizers import _overflow_record
from keras_amp_plus.optimizers._overflow_record import OverflowRecord

_COUNTERS = (
    "overflow_count",
    "nan_steps",
    "inf_steps",
    "last_step_skipped",
    "total_steps",
    "overflows_since_scale_change",
    "min_scale_overflow_count",
    "last_min_scale_overflow_step",
)


class TrackedVariables:
    """The variables the scaler was built with, in build order.

    A plain object on purpose: Keras's attribute tracker would adopt the model
    variables of a list attribute as optimizer variables.
    """

    def __init__(self, variables):
        self.variables = list(variables)
        self.index_by_id = {id(v): i for i, v in enumerate(self.variables)}

    def positions(self, variables):
        """Return each variable's column in the records, None when untracked."""
        return [self.index_by_id.get(id(v)) for v in variables]


def build_overflow_records(optimizer, var_list) -> None:
    """Create the overflow record variables on `optimizer`."""
    num_variables = len(var_list)
    capacity = optimizer.event_buffer_size

    def add(name, shape, dtype):
        variable = optimizer.add_variable(
            shape=shape,
            dtype=dtype,
            initializer="zeros",
            aggregation="only_first_replica",
            name=name,
        )
        setattr(optimizer, name, variable)

    for name in _COUNTERS:
        add(name, (), "int64")
    # Every name here is in _RECORDS.
    add("variable_overflow_counts", (num_variables,), "int64")
    add("event_steps", (capacity,), "int64")
    add("event_scales_before", (capacity,), "float32")
    add("event_scales_after", (capacity,), "float32")
    add("event_has_nan", (capacity,), "int64")
    add("event_variable_masks", (capacity, num_variables), "int64")
    add("event_loss_states", (capacity,), "int64")


class LossWatch:
    """The finiteness of the loss `scale_loss` saw, for `apply` of the same step.

    Keras's train step hands the loss to `scale_loss` and the gradients to
    `apply` in one trace, so the loss's finiteness is a tensor of that trace:
    nothing is stored in a variable. Replicas trace in their own threads,
    hence one slot per thread; a slot from another graph (a `scale_loss` whose
    step never called `apply`) is ignored.
    """

    def __init__(self):
        self._local = threading.local()
        self.ever_watched = False  # any loss, in any graph or eagerly

    def watch(self, loss) -> None:
        """Remember whether `loss` is finite (called by `scale_loss`)."""
        finite = tf.reduce_all(tf.math.is_finite(tf.convert_to_tensor(loss)))
        self._local.seen = (_current_graph(), finite)
        self.ever_watched = True

    def take(self):
        """Return the int64 loss-state code of this step's loss and forget it."""
        graph, finite = getattr(self._local, "seen", (None, None))
        self._local.seen = (None, None)
        if finite is None or graph is not _current_graph():
            return tf.constant(_overflow_record.LOSS_NOT_SEEN, tf.int64)
        return tf.where(
            finite,
            tf.constant(_overflow_record.LOSS_FINITE, tf.int64),
            tf.constant(_overflow_record.LOSS_NONFINITE, tf.int64),
        )


def _current_graph():
    """Return the graph being traced, or None when executing eagerly."""
    if tf.executing_eagerly():
        return None
    return tf.compat.v1.get_default_graph()


def _ring_slot(count, optimizer):
    """Return the ring slot of the `count`-th event (1-based)."""
    return (count - 1) % optimizer.event_buffer_size


def newest_loss_state(optimizer):
    """Return the `LossWatch` code of the newest event's loss (graph-safe).

    Read in the skipped-step branch, just after `record_skipped_step` wrote it.

    Args:
        optimizer: the built `LossScaleOptimizer`, with at least one event.
    """
    slot = _ring_slot(optimizer.overflow_count, optimizer)
    return tf.gather(tf.convert_to_tensor(optimizer.event_loss_states), slot)


def record_skipped_step(
    optimizer, step, nonfinite_mask, has_nan, scale_before, scale_after, loss_state
):
    """Write one overflow event (called in the skipped-step branch only).

    Args:
        optimizer: the built `LossScaleOptimizer`.
        step: int64 scalar, the 1-based `total_steps` value of this step.
        nonfinite_mask: bool `[num_variables]`, True where a gradient was not
            finite.
        has_nan: bool scalar, True when any gradient held a NaN.
        scale_before: float32 scalar, the scale this step was computed with.
        scale_after: float32 scalar, the scale after this step's backoff.
        loss_state: int64 scalar, the `LossWatch` code of the step's loss.
    """
    mask = tf.cast(nonfinite_mask, tf.int64)
    nan = tf.cast(has_nan, tf.int64)
    count = optimizer.overflow_count + 1
    slot = tf.reshape(_ring_slot(count, optimizer), (1, 1))

    optimizer.overflow_count.assign(count)
    optimizer.nan_steps.assign_add(nan)
    optimizer.inf_steps.assign_add(1 - nan)
    optimizer.variable_overflow_counts.assign_add(mask)

    def put(buffer, value):
        buffer.assign(
            tf.tensor_scatter_nd_update(
                tf.convert_to_tensor(buffer), slot, tf.expand_dims(value, 0)
            )
        )

    put(optimizer.event_steps, step)
    put(optimizer.event_scales_before, scale_before)
    put(optimizer.event_scales_after, scale_after)
    put(optimizer.event_has_nan, nan)
    put(optimizer.event_variable_masks, mask)
    put(optimizer.event_loss_states, loss_state)


_RECORDS = (
    *_COUNTERS,
    "variable_overflow_counts",
    "event_steps",
    "event_scales_before",
    "event_scales_after",
    "event_has_nan",
    "event_variable_masks",
    "event_loss_states",
)


# Records added after the first layout; files saved before hold none of them.
_LATER_RECORDS = ("event_loss_states",)


def _variables_without(optimizer, names) -> list:
    """Return the optimizer's variables in order, leaving out the named records."""
    left_out = {id(getattr(optimizer, name)) for name in names}
    return [v for v in optimizer.variables if id(v) not in left_out]


def _earlier_layouts(optimizer) -> list:
    """Return (variables saved, records left out) of each earlier file layout.

    Keras's own `LossScaleOptimizer` saves no records at all; our scaler's
    first layout saved every record but the later ones.
    """
    return [
        (_variables_without(optimizer, _LATER_RECORDS), _LATER_RECORDS),
        (_variables_without(optimizer, _RECORDS), _RECORDS),
    ]


def _matches(store, variables) -> bool:
    return len(store.keys()) == len(variables) and all(
        tuple(store[str(i)].shape) == tuple(v.shape) for i, v in enumerate(variables)
    )


def load_earlier_layout(optimizer, store) -> bool:
    """Load a store of an earlier layout; return False when it is the current one.

    A file saved with Keras's `LossScaleOptimizer` gives the scale, step counter
    and inner optimizer's variables, and the records start empty; a file of
    our scaler's first layout gives everything but the loss states, which read
    as "not seen"; a file saved with another `event_buffer_size` (raised, as
    the scaler's warning advises) gives everything, its newest events laid
    into this ring (`_load_resized_rings`).
    """
    if _matches(store, optimizer.variables):
        return False
    for variables, left_out in _earlier_layouts(optimizer):
        if _matches(store, variables):
            for i, variable in enumerate(variables):
                variable.assign(store[str(i)])
            if "event_loss_states" in left_out:
                states = optimizer.event_loss_states
                states.assign(tf.fill(states.shape, _overflow_record.LOSS_NOT_SEEN))
            return True
    return _load_resized_rings(optimizer, store)


# The event rings: one slot per event, `event_buffer_size` slots.
_RINGS = (
    "event_steps",
    "event_scales_before",
    "event_scales_after",
    "event_has_nan",
    "event_variable_masks",
    "event_loss_states",
)


# The step of a slot that holds no event: a ring relaid into a larger one
# holds fewer events than its capacity (`read_records` starts after them).
_NO_EVENT_STEP = -1


def _relaid(saved, shape, count, empty=0):
    """Return ring `saved` relaid into a ring of `shape`, after `count` events.

    Slots that hold none of the saved events read `empty`.
    """
    relaid = np.full(tuple(shape), empty, saved.dtype)
    newest_kept = min(count, len(saved), len(relaid))
    for event in range(count - newest_kept + 1, count + 1):
        relaid[(event - 1) % len(relaid)] = saved[(event - 1) % len(saved)]
    return relaid


def _load_resized_rings(optimizer, store) -> bool:
    """Load a store whose event rings have another capacity; False if it is not.

    Event `e` (1-based) sits in slot `(e - 1) % capacity`: the newest events
    the saved ring holds, as many as this one holds, move to their slots here.
    """
    variables = optimizer.variables
    rings = {id(getattr(optimizer, name)) for name in _RINGS}
    if len(store.keys()) != len(variables):
        return False
    for i, variable in enumerate(variables):
        saved = tuple(store[str(i)].shape)
        expected = tuple(variable.shape)
        if saved != expected and not (
            id(variable) in rings and saved[1:] == expected[1:]
        ):
            return False
    for i, variable in enumerate(variables):
        if id(variable) not in rings:
            variable.assign(store[str(i)])
    count = int(optimizer.overflow_count.numpy())
    steps = id(optimizer.event_steps)
    for i, variable in enumerate(variables):
        if id(variable) in rings:
            empty = _NO_EVENT_STEP if id(variable) == steps else 0
            saved = np.asarray(store[str(i)])
            variable.assign(_relaid(saved, variable.shape, count, empty))
    return True


def _oldest_held(count, capacity, steps) -> int:
    """Return the index of the newest event the ring no longer holds (0: none).

    The ring holds the newest `capacity` events, except after a smaller
    ring was relaid into it (`_load_resized_rings`): its slots that hold no
    event read `_NO_EVENT_STEP`.
    """
    oldest_held = max(count - capacity, 0)
    while oldest_held < count and steps[oldest_held % capacity] == _NO_EVENT_STEP:
        oldest_held += 1
    return oldest_held


def require_built(optimizer, method: str) -> None:
    """Raise a clear ValueError when the records do not exist yet."""
    if not optimizer.built:
        # Before build() the records do not exist; say so instead of letting an
        # AttributeError on a private attribute escape.
        raise ValueError(
            f"To call `{method}()`, the {type(optimizer).__name__} must be built "
            "(its records are created with its variables). Train first, or "
            "call `optimizer.build(model.trainable_variables)`. "
            "Received: optimizer.built=False"
        )


def overflow_summary(optimizer) -> dict:
    """Return the records as a plain-Python summary dict (one host read)."""
    require_built(optimizer, "overflow_summary")
    paths = tracked_variable_paths(optimizer)
    counts = optimizer.variable_overflow_counts.numpy().tolist()
    return {
        "overflow_count": int(optimizer.overflow_count.numpy()),
        "nan_steps": int(optimizer.nan_steps.numpy()),
        "inf_steps": int(optimizer.inf_steps.numpy()),
        "last_step_skipped": bool(optimizer.last_step_skipped.numpy()),
        "loss_scale": float(optimizer.dynamic_scale.numpy()),
        "by_variable": dict(zip(paths, (int(c) for c in counts), strict=True)),
    }


def tracked_variable_paths(optimizer) -> list:
    """Return the variable paths in the order of the per-variable records.

    Each path once: a path that repeats (on Keras 2, custom layers reloaded
    from a `.keras` file by another library may name their variables
    "gamma:0" alike) gets its rank after it, `"gamma#2"`.
    """
    require_built(optimizer, "tracked_variable_paths")
    paths = [_compat.variable_path(v) for v in tracked_variables(optimizer)]
    seen = collections.Counter()
    unique = []
    for path in paths:
        seen[path] += 1
        unique.append(path if seen[path] == 1 else f"{path}#{seen[path]}")
    return unique


def tracked_variables(optimizer) -> list:
    """Return the variables of the per-variable records, in their order."""
    require_built(optimizer, "tracked_variables")
    return list(optimizer._tracked.variables)


def read_records(optimizer, since_count: int = 0) -> list[OverflowRecord]:
    """Return the records whose overflow index is greater than `since_count`.

    Events older than the ring buffer's capacity are gone: a warning says how
    many were lost, and the oldest events still held are returned. A
    `since_count` at or above `overflow_count` returns no events.
    """
    require_built(optimizer, "read_events")
    if isinstance(since_count, bool) or not isinstance(since_count, numbers.Integral):
        raise TypeError(
            "`since_count` must be an int: the `overflow_count` last seen (0 for "
            f"all events). Received: since_count={since_count!r}"
        )
    if since_count < 0:
        # A negative count would otherwise read as overwritten events.
        raise ValueError(
            "`since_count` must be >= 0: the `overflow_count` last seen (0 for "
            f"all events). Received: since_count={since_count!r}"
        )
    count = int(optimizer.overflow_count.numpy())
    capacity = optimizer.event_buffer_size
    steps = optimizer.event_steps.numpy()
    oldest_held = _oldest_held(count, capacity, steps)
    if since_count < oldest_held:
        warnings.warn(
            f"{oldest_held - since_count} overflow events were overwritten in "
            f"the ring buffer (capacity event_buffer_size={capacity}) before "
            "they were read. Read events more often or raise "
            f"`event_buffer_size`. Received: since_count={since_count}, "
            f"overflow_count={count}",
            stacklevel=3,
        )
        since_count = oldest_held
    if count <= since_count:
        return []
    paths = tracked_variable_paths(optimizer)
    before = optimizer.event_scales_before.numpy()
    after = optimizer.event_scales_after.numpy()
    has_nan = optimizer.event_has_nan.numpy()
    masks = optimizer.event_variable_masks.numpy()
    loss_states = optimizer.event_loss_states.numpy()
    records = []
    for index in range(since_count + 1, count + 1):
        slot = (index - 1) % capacity
        records.append(
            OverflowRecord(
                index=index,
                step=int(steps[slot]),
                scale_before=float(before[slot]),
                scale_after=float(after[slot]),
                has_nan=bool(has_nan[slot]),
                variables=tuple(
                    p for p, m in zip(paths, masks[slot], strict=True) if m
                ),
                loss_finite=_overflow_record.loss_state(loss_states[slot]),
            )
        )
    return records

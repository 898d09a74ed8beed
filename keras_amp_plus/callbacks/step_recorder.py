"""In-graph recording of overflow events, read by `AMPMonitor` every N steps.

The recorder wraps the model's `train_step` and `compute_loss` on the instance
(both are public override points: Keras's TF trainer calls `self.train_step(data)`
inside the compiled train function, and `train_step` calls `self.compute_loss`).
Inside the compiled step it compares the loss scale before and after the step and
checks the loss for Inf/NaN, and only on an overflow step (inside a `tf.cond`,
so normal steps pay a few scalar ops) writes one slot of a ring buffer of
capacity K and copies the batch into shape-agnostic variables so that the
monitor can replay it later. Nothing is read by the host inside the step: the
monitor reads the counters every N <= K steps, which keeps every event exact.
"""

import numpy as np
import tensorflow as tf

from keras_amp_plus import _compat

SCALER_KAP = "keras_amp_plus"
SCALER_KERAS = "keras"
SCALER_NONE = "none"


def scaler_kind(optimizer) -> str:
    """Return which loss scaler wraps `optimizer`: ours, Keras's own, or none."""
    if hasattr(optimizer, "read_events") and hasattr(optimizer, "overflow_count"):
        return SCALER_KAP
    if isinstance(optimizer, _compat.KerasLossScaleOptimizer):
        return SCALER_KERAS
    return SCALER_NONE


def _int_variable(name, shape=()):
    return tf.Variable(tf.zeros(shape, tf.int64), trainable=False, name=name)


def _float_variable(name, shape=()):
    return tf.Variable(tf.zeros(shape, tf.float32), trainable=False, name=name)


class StepRecorder:
    """Counts overflow steps in graph variables and keeps the last bad batch.

    An event is a step on which the scaler skipped the update (ours: its
    `last_step_skipped`; Keras's: the loss scale went down) or, for every
    scaler and for none, a step whose loss was Inf or NaN.

    Args:
        model: the compiled Keras model to instrument.
        capacity: number of events the ring buffer holds between two reads.
    """

    def __init__(self, model, capacity: int):
        self.model = model
        self.optimizer = model.optimizer
        self.kind = scaler_kind(self.optimizer)
        self.capacity = capacity
        self.total_steps = _int_variable("amp_monitor_total_steps")
        self.event_count = _int_variable("amp_monitor_event_count")
        self.event_steps = _int_variable("amp_monitor_event_steps", [capacity])
        self.scales_before = _float_variable("amp_monitor_scales_before", [capacity])
        self.scales_after = _float_variable("amp_monitor_scales_after", [capacity])
        self.loss_nonfinite = _int_variable("amp_monitor_loss_nonfinite", [capacity])
        self.loss_has_nan = _int_variable("amp_monitor_loss_has_nan", [capacity])
        self.stash_step = _int_variable("amp_monitor_stash_step")
        self._stash_variables = None
        self._stash_structure = None
        self._captured_losses = None
        self._saved_attributes = {}
        self.loss_watched = True

    # -- installing the wrappers -------------------------------------------------
    def install(self) -> None:
        """Wrap `train_step`/`compute_loss` on the instance and rebuild `fit`'s step."""
        model = self.model
        for name in ("train_step", "compute_loss"):
            previous = model.__dict__.get(name)
            # A `fit` that died in an exception never ran `on_train_end`: drop
            # that run's wrapper instead of wrapping it again.
            while hasattr(previous, "_amp_monitor_original"):
                previous = previous._amp_monitor_original
            self._saved_attributes[name] = previous
            if previous is None:
                model.__dict__.pop(name, None)
            else:
                setattr(model, name, previous)
        original_train_step = model.train_step
        original_compute_loss = model.compute_loss

        def compute_loss(*args, **kwargs):
            loss = original_compute_loss(*args, **kwargs)
            if self._captured_losses is not None:
                self._captured_losses.append(loss)
            return loss

        def train_step(data):
            self._captured_losses = []
            scale_before = self._read_scale()
            outputs = original_train_step(data)
            losses, self._captured_losses = self._captured_losses, None
            self._record_step(data, scale_before, losses)
            return outputs

        compute_loss._amp_monitor_original = self._saved_attributes["compute_loss"]
        train_step._amp_monitor_original = self._saved_attributes["train_step"]
        model.compute_loss = compute_loss
        model.train_step = train_step
        # `fit` built its train function before `on_train_begin`; rebuilding it
        # (not deleting it) makes the next step trace through the wrappers.
        model.make_train_function(force=True)

    def uninstall(self) -> None:
        """Put back the model's own `train_step`/`compute_loss`."""
        for name, previous in self._saved_attributes.items():
            if previous is None:
                self.model.__dict__.pop(name, None)
            else:
                setattr(self.model, name, previous)
        self._saved_attributes = {}
        self.model.make_train_function(force=True)

    # -- graph side --------------------------------------------------------------
    def _read_scale(self):
        if self.kind == SCALER_NONE:
            return tf.constant(float("nan"), tf.float32)
        scale = _compat.current_loss_scale(self.optimizer)
        return tf.identity(tf.cast(scale, tf.float32))

    def _record_step(self, data, scale_before, losses):
        # A custom `train_step` may compute its loss without `compute_loss`:
        # then the loss is not watched and every event's batch is kept.
        self.loss_watched = bool(losses)
        loss_nonfinite = tf.constant(False)
        loss_has_nan = tf.constant(False)
        for loss in losses:
            loss = tf.convert_to_tensor(loss)
            loss_nonfinite |= tf.reduce_any(~tf.math.is_finite(loss))
            loss_has_nan |= tf.reduce_any(tf.math.is_nan(loss))
        scale_after = self._read_scale()
        if self.kind == SCALER_KAP:
            skipped = self.optimizer.last_step_skipped > 0
        elif self.kind == SCALER_KERAS:
            skipped = scale_after < scale_before
        else:
            skipped = tf.constant(False)
        is_event = skipped | loss_nonfinite
        self.total_steps.assign_add(1)
        if self.kind == SCALER_KAP:
            step = tf.cast(self.optimizer.total_steps, tf.int64)
        else:
            step = self.total_steps.read_value()
        leaves = self._stash_leaves(data)

        def record():
            slot = self.event_count % self.capacity
            self.event_steps[slot].assign(step)
            self.scales_before[slot].assign(scale_before)
            self.scales_after[slot].assign(scale_after)
            self.loss_nonfinite[slot].assign(tf.cast(loss_nonfinite, tf.int64))
            self.loss_has_nan[slot].assign(tf.cast(loss_has_nan, tf.int64))
            keep = loss_nonfinite if self.loss_watched else tf.constant(True)
            tf.cond(keep, stash, lambda: tf.constant(0))
            self.event_count.assign_add(1)
            return tf.constant(0)

        def stash():
            # Only forward overflows are replayed, so only their batch is kept.
            for variable, tensor in zip(self._stash_variables, leaves, strict=True):
                variable.assign(tensor)
            self.stash_step.assign(step)
            return tf.constant(0)

        tf.cond(is_event, record, lambda: tf.constant(0))

    def _stash_leaves(self, data):
        """Return the batch's tensors; create their stash variables on first use."""
        flat = tf.nest.flatten(data)
        leaves = [tf.convert_to_tensor(t) for t in flat if t is not None]
        dtypes = [t.dtype for t in leaves]
        if (
            self._stash_variables is None
            or [v.dtype for v in self._stash_variables] != dtypes
        ):
            # Lifted out of the traced function: created once, eagerly, with an
            # unknown shape so any batch shape can be stored.
            with tf.init_scope():
                self._stash_variables = [
                    tf.Variable(
                        tf.zeros([0] * t.shape.rank, t.dtype),
                        shape=tf.TensorShape(None),
                        trainable=False,
                    )
                    for t in leaves
                ]
        self._stash_structure = (data, [t is None for t in flat])
        return leaves

    # -- host side ---------------------------------------------------------------
    def stashed_batch(self):
        """Return `(step, data)` of the last overflow step, or `(0, None)`."""
        step = int(self.stash_step.numpy())
        if step == 0 or self._stash_variables is None:
            return 0, None
        structure, is_none = self._stash_structure
        values = iter([tf.convert_to_tensor(v) for v in self._stash_variables])
        flat = [None if none else next(values) for none in is_none]
        return step, tf.nest.pack_sequence_as(structure, flat)

    def read_events(self, since_count: int) -> tuple[list[dict], int]:
        """Return the events recorded after the `since_count`-th and the new count.

        Events older than the ring buffer's capacity are gone: then fewer than
        `count - since_count` events are returned.
        """
        count = int(self.event_count.numpy())
        if count <= since_count:
            return [], count
        first = max(since_count, count - self.capacity)
        slots = [index % self.capacity for index in range(first, count)]
        steps = self.event_steps.numpy()[slots]
        before = self.scales_before.numpy()[slots]
        after = self.scales_after.numpy()[slots]
        nonfinite = self.loss_nonfinite.numpy()[slots]
        has_nan = self.loss_has_nan.numpy()[slots]
        events = []
        for i, index in enumerate(range(first, count)):
            events.append(
                {
                    "index": index + 1,
                    "step": int(steps[i]),
                    "scale_before": _finite_or_none(before[i]),
                    "scale_after": _finite_or_none(after[i]),
                    "loss_nonfinite": bool(nonfinite[i]),
                    "loss_has_nan": bool(has_nan[i]),
                }
            )
        return events, count

    def restore_counters(self, total_steps: int, event_count: int) -> None:
        """Set the counters after a resume so step numbers continue exactly."""
        self.total_steps.assign(total_steps)
        self.event_count.assign(event_count)


def _finite_or_none(value):
    value = float(value)
    return value if np.isfinite(value) else None

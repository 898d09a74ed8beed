"""In-graph recording of what the loss scaler cannot see, read every N steps.

The recorder wraps the model's `train_step` and `compute_loss` on the instance
(both are public override points: Keras's TF trainer calls `self.train_step(data)`
inside the compiled train function, and `train_step` calls `self.compute_loss`).

With our `LossScaleOptimizer` the scaler records every overflow event itself
(`OverflowRecord`s, with the loss's finiteness), and the recorder keeps only
what the scaler cannot see: the batch of the last step whose loss was Inf/NaN,
for the replay that names the layer, and the order the layers ran in. With
Keras's own scaler or no scaler it also detects the events (the scale went
down, or the loss was Inf/NaN) and writes them, only on an overflow step
(inside a `tf.cond`, so normal steps pay a few scalar ops), to a ring buffer of
capacity K. Nothing is read by the host inside the step: the monitor reads
every N <= K steps, which keeps every event exact.

Every update has a static shape (a slot is written with
`tensor_scatter_nd_update`, never with an assignment at a run-time index), so
the recording compiles with XLA. Under `jit_compile=True` the recorder builds
`fit`'s step as a graph function and compiles the model's step and the
recording in it with XLA itself; only the batch's stash runs in the graph
around it (inside XLA a conditional copies the batch-sized buffers it may
write on every step, taken or not). The model's `jit_compile` is left as the
user set it, and validation and prediction stay compiled. Where that split is
not possible (Keras 2.15, `MirroredStrategy`) Keras compiles the whole step and
the batch is kept with a select instead.

The variables are created in the model's distribution strategy scope,
synchronized on read with ONLY_FIRST_REPLICA aggregation, and the event
decision is all-reduced over the replicas first, so under
`tf.distribute.MirroredStrategy` every replica takes the same branch and an
overflow step counts once.

While the step is traced, the order in which the model's leaf layers are
called is recorded (`call_order`): it is the forward order the attribution of
backward overflows uses.
"""

import re
import threading

import keras
import numpy as np
import tensorflow as tf

from keras_amp_plus import _compat
from keras_amp_plus._lists.layer_names import candidate_layers
from keras_amp_plus.callbacks import _distribution as distribution
from keras_amp_plus.optimizers import (
    LossScaleOptimizer,
    _overflow_record,
    _overflow_records,
)
from keras_amp_plus.optimizers._overflow_record import OverflowRecord

SCALER_KAP = "keras_amp_plus"
SCALER_KERAS = "keras"
SCALER_NONE = "none"


def scaler_kind(optimizer) -> str:
    """Return which loss scaler wraps `optimizer`: ours, Keras's own, or none."""
    if isinstance(optimizer, LossScaleOptimizer):
        return SCALER_KAP
    if isinstance(optimizer, _compat.KerasLossScaleOptimizer):
        return SCALER_KERAS
    return SCALER_NONE


# The model's methods the recorder wraps on the instance while it is installed.
WRAPPED_ATTRIBUTES = (
    "train_step",
    "compute_loss",
    "make_train_function",
    "get_metrics_result",
)


# What a train function raises at the end of the data: `fit` catches it.
END_OF_DATA = (StopIteration, tf.errors.OutOfRangeError)


# What a metric reads after an epoch with no applied step, by the way it
# improves: never better than a measured value, for `EarlyStopping`,
# `ModelCheckpoint(save_best_only=True)` and `ReduceLROnPlateau` (Keras 3
# takes the first value they see for the best, NaN included, and no value
# beats NaN after it). NaN where the direction is unknown.
_WORST = {"down": float("inf"), "up": float("-inf")}


def _no_value_like(value, direction):
    """Return the worst `value` of `direction` (float results); others unchanged."""
    value = tf.convert_to_tensor(value)
    if not value.dtype.is_floating:
        return value
    worst = _WORST.get(direction, float("nan"))
    return tf.fill(tf.shape(value), tf.constant(worst, value.dtype))


def _holds_nan(value) -> bool:
    """Return whether the metric result `value` is a float holding a NaN."""
    value = tf.convert_to_tensor(value)
    return value.dtype.is_floating and bool(tf.reduce_any(tf.math.is_nan(value)))


def _metric_directions(model) -> dict:
    """Return `{result name: "up" or "down"}` for the model's known metrics."""
    directions = {}
    for metric in model.metrics:
        # `compile`'s metrics come as one container of the metrics it built.
        for inner in (metric, *getattr(metric, "metrics", ())):
            direction = _compat.metric_direction(inner)
            if direction is not None:
                directions[inner.name] = direction
    return directions


def _is_loss(name) -> bool:
    """Return whether the result `name` is the loss or one output's loss."""
    return name == "loss" or name.endswith("_loss")


def _direction_of(name, directions):
    """Return the direction of the result `name` (`_metric_directions`), or None.

    A multi-output model's results carry the output's name before the
    metric's (`"out_accuracy"`) and a number after duplicates (`"mae_1"`).
    """
    if _is_loss(name):
        return "down"
    bare = re.sub(r"_\d+$", "", name)
    for candidate in (name, bare):
        if candidate in directions:
            return directions[candidate]
    suffixes = [m for m in directions if bare.endswith("_" + m)]
    return directions[max(suffixes, key=len)] if suffixes else None


def _variable(name, shape, dtype):
    return tf.Variable(
        tf.zeros(shape, dtype),
        trainable=False,
        name=name,
        # Each replica writes its own copy in replica context, without a
        # merge_call (not allowed inside the step's tf.cond); the host reads
        # the first replica's. The decision to write is all-reduced first, so
        # every copy holds the same counters.
        synchronization=tf.VariableSynchronization.ON_READ,
        aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
    )


def _put(buffer, slot, value):
    """Write `value` at `slot` of `buffer` with a static-shape update (XLA)."""
    updated = tf.tensor_scatter_nd_update(
        tf.convert_to_tensor(buffer),
        tf.reshape(slot, (1, 1)),
        tf.reshape(tf.cast(value, buffer.dtype), (1,)),
    )
    buffer.assign(updated)


def _restore(saved, counter):
    """Assign each `(variable, value before the step)` pair back; count it."""
    for variable, before in saved:
        variable.assign(before)
    counter.assign_add(1)
    return tf.constant(0)


def _as_numeric_tensor(value):
    """Return `value` as a numeric tensor, or None (strings, nested logs)."""
    try:
        tensor = tf.convert_to_tensor(value)
    except (TypeError, ValueError):
        return None
    return tensor if tensor.dtype.is_floating or tensor.dtype.is_integer else None


def _all_finite(tensor):
    """Return a boolean tensor: whether a numeric tensor holds no Inf or NaN."""
    if not tensor.dtype.is_floating:
        return tf.constant(True)
    return tf.reduce_all(tf.math.is_finite(tensor))


def _changed(saved):
    """Return whether any `(variable, value before the step)` pair differs."""
    changed = tf.constant(False)
    for variable, before in saved:
        changed |= tf.reduce_any(tf.not_equal(tf.convert_to_tensor(variable), before))
    return changed


def _all_replicas_any(flag):
    """Return True on every replica when `flag` is True on any of them."""
    context = tf.distribute.get_replica_context()
    if context is None or context.num_replicas_in_sync == 1:
        return flag
    total = context.all_reduce(tf.distribute.ReduceOp.SUM, tf.cast(flag, tf.int32))
    return total > 0


class StepRecorder:
    """Keeps the last bad batch; detects events when our scaler is not there.

    With Keras's scaler or none, an event is a step on which the scale went
    down (a skipped step) or whose loss was Inf or NaN; with ours the scaler
    records the events (see module doc).

    Args:
        model: the compiled Keras model to instrument.
        capacity: number of events the ring buffer holds between two reads.
        exclude_skipped_steps: put the model's metrics back to their values
            before a step the scaler skipped, so its Inf/NaN loss is not
            averaged into the epoch's `loss`. Defaults to `True`.
        trusted_backward_scale: the batch of a step skipped at a loss scale at
            or below this is kept too: a forward overflow hidden from the
            loss (max pooling can drop NaNs) shows only as such a step, and
            the replay finds it. Defaults to `1.0`.
    """

    def __init__(
        self,
        model,
        capacity: int,
        exclude_skipped_steps: bool = True,
        trusted_backward_scale: float = 1.0,
    ):
        self.model = model
        self.optimizer = model.optimizer
        self.kind = scaler_kind(self.optimizer)
        self.capacity = capacity
        self.exclude_skipped_steps = exclude_skipped_steps
        self.trusted_backward_scale = float(trusted_backward_scale)
        self.strategy = model.distribute_strategy
        with self.strategy.scope():
            self.total_steps = _variable("amp_monitor_total_steps", (), tf.int64)
            self.event_count = _variable("amp_monitor_event_count", (), tf.int64)
            # Skipped steps whose metrics updates were put back.
            self.left_out_steps = _variable("amp_monitor_left_out_steps", (), tf.int64)
            self.stash_step = _variable("amp_monitor_stash_step", (), tf.int64)
            # The steps whose kept batch held Inf or NaN (bad data, no
            # layer's overflow), a ring as long as the event ring: the stash
            # holds one batch, and events read together are replayed once.
            self._bad_batch_ring = _variable(
                "amp_monitor_bad_batch_steps", [capacity], tf.int64
            )
            self._bad_batch_count = _variable(
                "amp_monitor_bad_batch_count", (), tf.int64
            )
            # Our scaler records the events itself: no ring of our own then.
            self.ring = None if self.kind == SCALER_KAP else _EventRing(capacity)
        self._stash_variables = None
        self._stash_structure = None
        # Replicas of a MirroredStrategy trace the step in their own threads.
        self._local = threading.local()
        self._saved_attributes = {}
        self._steps_before_epoch = 0
        self._left_out_before_epoch = 0
        # Called when a step raises (`_stopping_cleanly`); the session's.
        self.on_abort = lambda: None
        # Called when a new `fit` of the model finds the wrappers still
        # installed (`_unfinished_fits`); the session's.
        self.on_unfinished_fit = lambda: None
        self.loss_watched = True
        self.call_order = []
        self.installed = False
        self.compiles_model_step = False
        # Set while `fit` validates (`on_test_begin` .. `on_test_end`).
        self.validating = False
        self.nan_validation_metrics = []

    # -- installing the wrappers -------------------------------------------------
    def install(self) -> None:
        """Wrap the model's step on the instance; the caller then rebuilds it.

        Wraps `train_step` and `compute_loss`, `get_metrics_result` (see
        `_wrap_get_metrics_result`) and `make_train_function` (see
        `_wrap_make_train_function`).
        """
        model = self.model
        self._unwrap_previous(model)
        self.compiles_model_step = self.can_compile_model_step()
        wrappers = {
            "compute_loss": self._wrap_compute_loss(model.compute_loss),
            "train_step": self._wrap_train_step(model.train_step),
            "make_train_function": self._wrap_make_train_function(
                model.make_train_function
            ),
            "get_metrics_result": self._wrap_get_metrics_result(
                model.get_metrics_result
            ),
        }
        for name, wrapper in wrappers.items():
            wrapper._amp_monitor_original = self._saved_attributes[name]
            setattr(model, name, wrapper)
        self.installed = True

    def can_compile_model_step(self) -> bool:
        """Return True when the recorder compiles the model's step with XLA itself.

        Only under `jit_compile=True`, where `fit`'s step can be built without
        XLA (Keras 3), and where the step may call a nested XLA function that
        updates the optimizer (no strategy, or one device: under
        `MirroredStrategy` TF refuses the optimizer's `merge_call` there).
        Elsewhere Keras compiles the whole step, recording included.
        """
        model = self.model
        return (
            _compat.jit_compile_on(model)
            and _compat.CAN_BUILD_TRAIN_FUNCTION_WITHOUT_XLA
            and distribution.allows_nested_xla_step(model.distribute_strategy)
        )

    def _unwrap_previous(self, model) -> None:
        """Remember the model's own attributes, without any earlier wrapper."""
        for name in WRAPPED_ATTRIBUTES:
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

    def begin_epoch(self) -> None:
        """Note where the epoch starts (`fit` has just reset the metrics)."""
        self._steps_before_epoch = int(self.total_steps.numpy())
        self._left_out_before_epoch = int(self.left_out_steps.numpy())

    def steps_in_epoch(self) -> int:
        """Return the train steps the current epoch ran so far.

        Counted in the step itself: `fit`'s batch hooks see only the first
        step of each execution under `steps_per_execution`.
        """
        return int(self.total_steps.numpy()) - self._steps_before_epoch

    def _wrap_get_metrics_result(self, original_get_metrics_result):
        """Report the worst value, not Keras's 0, for metrics no step measured.

        Where the skipped steps are left out of the metrics
        (`exclude_skipped_steps`) and every step of the epoch so far was
        skipped, the metrics hold no value: Keras would report their empty
        state as 0, a loss that `ModelCheckpoint(save_best_only=True)` takes
        for the best. Instead the loss (and metrics that improve downwards)
        reads `inf`, those that improve upwards (accuracy) `-inf`, others
        NaN: no measured value is worse, so any later measured epoch beats
        it (Keras 3's callbacks take a first epoch for the best whatever its
        value, and no value ever beats a NaN). `fit` reads the epoch's logs
        through this method before any callback sees them, so every
        callback, before the monitor or after it, sees these. Inside the
        step's function it is Keras's own.
        """

        def get_metrics_result():
            results = original_get_metrics_result()
            if tf.inside_function():
                return results
            if self.validating:
                return self._validation_results(results)
            if not self._every_step_left_out():
                return results
            directions = _metric_directions(self.model)
            return {
                name: _no_value_like(value, _direction_of(name, directions))
                for name, value in results.items()
            }

        return get_metrics_result

    def _validation_results(self, results) -> dict:
        """Report `fit`'s NaN validation results as their worst values.

        Validation runs before any callback's `on_epoch_end`, so after an
        epoch of float16 overflows it evaluates the model as it was before
        the monitor denies the layer: its loss is often NaN. Keras 3's
        `EarlyStopping` and `ModelCheckpoint(save_best_only=True)` would take
        a first NaN for the best forever (no value beats it) and restore or
        keep the untrained weights. A NaN result whose direction is known
        reads `inf` (loss) or `-inf` (accuracy) instead, which any later
        measured epoch beats; its name is noted for the epoch's warning.
        A NaN loss means NaN outputs, and the other metrics were measured on
        them (an argmax of NaN picks class 0: an accuracy as high as class
        0's share): they read their worst values too, or NaN where the
        direction is unknown and NaN is never a callback's best (Keras 2);
        Keras 3's take a first NaN for the best, so there such a metric keeps
        its value.
        """
        directions = _metric_directions(self.model)
        nan_loss = any(
            _is_loss(name) and _holds_nan(value) for name, value in results.items()
        )
        reported = {}
        for name, value in results.items():
            direction = _direction_of(name, directions)
            known = direction is not None or _compat.NAN_IS_NEVER_THE_BEST
            if known and (nan_loss or _holds_nan(value)):
                self.nan_validation_metrics.append(name)
                value = _no_value_like(value, direction)
            reported[name] = value
        return reported

    def _every_step_left_out(self) -> bool:
        """Return True when the epoch ran steps, each left out of the metrics.

        A custom `train_step` may log values of its own and leave the
        compiled metrics untouched: their zeros then say nothing.
        """
        if self._metric_values() is None:  # nothing is left out
            return False
        steps = self.steps_in_epoch()
        left_out = int(self.left_out_steps.numpy()) - self._left_out_before_epoch
        # Put back after each skipped step, the metrics still hold the
        # zeros `fit` reset them to at the epoch's start.
        variables = self._metric_variables()
        return (
            steps > 0
            and left_out >= steps
            and not any(np.any(v.numpy()) for v in variables)
        )

    def _wrap_compute_loss(self, original_compute_loss):
        def compute_loss(*args, **kwargs):
            loss = original_compute_loss(*args, **kwargs)
            captured = getattr(self._local, "losses", None)
            if captured is not None:
                captured.append(loss)
            return loss

        return compute_loss

    def _wrap_train_step(self, original_train_step):
        def recorded_step(data, leaves):
            """Run the model's step, then record it (stashing when `leaves`)."""
            scale_before = self._read_scale()
            saved_metrics = self._metric_values()
            self._local.losses = []
            with _CallOrder(self.model) as order:
                outputs = original_train_step(data)
            if order.layers:
                self.call_order = order.layers
            losses, self._local.losses = self._local.losses, None
            updated = None if saved_metrics is None else _changed(saved_metrics)
            keep, step, left_out = self._record_step(
                leaves, scale_before, losses, saved_metrics
            )
            if saved_metrics is not None:
                # Logs the step took from the metrics, put back: theirs again.
                outputs = self._metrics_result(
                    outputs, left_out & updated, self._metrics_hold_a_step()
                )
            return outputs, keep, step

        def train_step(data):
            leaves = self._stash_leaves(data)
            if not self.compiles_model_step or _compat.in_xla_compiled_function():
                return recorded_step(data, leaves)[0]
            # XLA compiles the step and the scalar recording; the batch's
            # stash runs in the graph around it: inside XLA a conditional
            # copies the batch-sized buffers on every step, taken or not.
            # A new function per trace: a rebuilt step traces the model again.
            compiled = tf.function(
                lambda data: recorded_step(data, None),
                jit_compile=True,
                autograph=False,
            )
            outputs, keep, step = compiled(data)
            tf.cond(keep, lambda: self._stash(leaves, step), lambda: tf.constant(0))
            return outputs

        return train_step

    def _wrap_make_train_function(self, original_make_train_function):
        """Build `fit`'s step without XLA when `train_step` compiles it itself.

        Each built step ends the monitor's `fit` when it raises
        (`_stopping_cleanly`); a new `fit` finding the wrapper ends the one
        that stopped outside a step (`_unfinished_fits`).
        """

        def make_train_function(force=False):
            if not force:
                # Only `fit` and `train_on_batch` build it without `force`: a
                # new call, unless from a callback of the monitored `fit`,
                # means that `fit` stopped without ending (`_unfinished_fits`).
                self.on_unfinished_fit()
                if not self.installed:
                    return self.model.make_train_function(force=force)
            # Decided when the step is built: the model's setting of now.
            self.compiles_model_step = self.can_compile_model_step()
            if not self.compiles_model_step:
                built = original_make_train_function(force=force)
            else:
                with _compat.train_function_built_without_xla(self.model):
                    built = original_make_train_function(force=force)
            model = self.model
            model.train_function = self._stopping_cleanly(model.train_function)
            # Keras 2 returns the function (and `fit` keeps the returned one).
            return None if built is None else model.train_function

        return make_train_function

    def _stopping_cleanly(self, train_function):
        """Return `train_function` calling `on_abort` when a step raises.

        `fit` calls no callback when it stops on an exception (a
        `KeyboardInterrupt`, an error in the step), so the monitor would
        leave its global switches on (a graph engine's rewrite) for every
        later model of the process. The end of the data is no such stop:
        Keras catches it and ends the epoch.
        """
        if train_function is None or hasattr(train_function, "_amp_monitor_guard"):
            return train_function

        def train_function_stopping_cleanly(*args, **kwargs):
            try:
                return train_function(*args, **kwargs)
            except END_OF_DATA:
                raise
            except BaseException:
                self.on_abort()
                raise

        train_function_stopping_cleanly._amp_monitor_guard = True
        return train_function_stopping_cleanly

    def uninstall(self) -> None:
        """Put back the model's own `train_step`/`compute_loss`."""
        for name, previous in self._saved_attributes.items():
            if previous is None:
                self.model.__dict__.pop(name, None)
            else:
                setattr(self.model, name, previous)
        self._saved_attributes = {}
        self.installed = False

    # -- graph side --------------------------------------------------------------
    def _read_scale(self):
        if self.kind != SCALER_KERAS:  # ours records it; none has no scale
            return tf.constant(float("nan"), tf.float32)
        scale = _compat.current_loss_scale(self.optimizer)
        return tf.identity(tf.cast(scale, tf.float32))

    def _metric_variables(self):
        return [v for metric in self.model.metrics for v in metric.variables]

    def _metric_values(self):
        if not self.exclude_skipped_steps or self.kind == SCALER_NONE:
            return None
        # Metrics built by this very step (the first trace) are not restored.
        return [(v, tf.identity(v)) for v in self._metric_variables()]

    def _metrics_hold_a_step(self):
        """Return a boolean tensor: whether the metrics hold any step's values.

        `fit` resets them to zeros at each epoch's start, and a step left
        out of them puts them back; any step they took leaves a nonzero
        count.
        """
        variables = self._metric_variables()
        if not variables:
            return tf.constant(False)
        return tf.reduce_any(
            [tf.reduce_any(tf.not_equal(v, tf.zeros_like(v))) for v in variables]
        )

    def _metrics_result(self, outputs, replace, metrics_hold_a_step):
        """Return the step's logs, from the metrics where `replace` is True.

        `replace`: the step updated the metrics (its logs are theirs, as
        Keras's own `train_step` returns) and was left out of them. A custom
        `train_step` logging values of its own keeps them. Before the
        epoch's first applied step (`metrics_hold_a_step` False) the metrics
        hold no value: a step keeps its own finite values (a step skipped
        for a backward overflow, as the scaler's first steps are, has a
        real loss), and a non-finite one reads the metrics' empty 0, since
        `TerminateOnNaN` would stop the run at that skipped step, before
        the monitor can deny the layer (the epoch's logs then read the worst
        values, `_wrap_get_metrics_result`).
        """
        results = self.model.get_metrics_result()
        if not (isinstance(outputs, dict) and set(outputs) == set(results)):
            return outputs
        replaced = dict(outputs)
        for name, value in results.items():
            own = _as_numeric_tensor(outputs[name])
            value = tf.convert_to_tensor(value)
            if own is None or own.shape.num_elements() != value.shape.num_elements():
                continue  # a log of the step's own (a per-example loss, ...)
            # Shaped like the step's own logs (`prepare_multi_worker_fit`
            # gives them a leading axis).
            value = tf.cast(tf.reshape(value, tf.shape(own)), own.dtype)
            keeps_own = tf.logical_not(metrics_hold_a_step) & _all_finite(own)
            replaced[name] = tf.where(replace & tf.logical_not(keeps_own), value, own)
        return replaced

    def _record_step(self, leaves, scale_before, losses, saved_metrics):
        """Record what the scaler cannot see, only on a skipped/overflow step.

        Everything happens in one `tf.cond`, so a normal step pays a few
        scalar ops and one conditional. The batch `leaves` are stashed here
        unless None (the caller stashes then). Returns `(keep, step,
        left_out)`: whether this step's batch is to be kept for the replay
        (None when it was decided and done here), its step number, and
        whether its metrics updates were put back.
        """
        # Inside XLA a conditional copies every variable its branch may write
        # on every step, taken or not; a select reads and writes the batch once.
        stash_by_select = leaves is not None and _compat.in_xla_compiled_function()
        # A custom `train_step` may compute its loss without `compute_loss`:
        # then the loss is not watched and every event's batch is kept.
        self.loss_watched = bool(losses)
        self.total_steps.assign_add(1)
        if self.kind == SCALER_KAP:
            # Our scaler records the event and whether its loss was finite
            # (reduced over replicas); the batch is all that is ours.
            skipped = self.optimizer.last_step_skipped > 0
            step = tf.cast(self.optimizer.total_steps, tf.int64)
            is_event = skipped
            # Read in the event branch only (in a graph step, normal steps
            # pay nothing for it); inside XLA it fuses into the step.
            keep_fn = lambda: (  # noqa: E731
                self._scaler_loss_not_finite() | self._at_trusted_scale()
            )
        else:
            loss_nonfinite = tf.constant(False)
            loss_has_nan = tf.constant(False)
            for loss in losses:
                loss = tf.convert_to_tensor(loss)
                loss_nonfinite |= tf.reduce_any(~tf.math.is_finite(loss))
                loss_has_nan |= tf.reduce_any(tf.math.is_nan(loss))
            loss_nonfinite = _all_replicas_any(loss_nonfinite)
            loss_has_nan = _all_replicas_any(loss_has_nan)
            scale_after = self._read_scale()
            if self.kind == SCALER_KERAS:
                skipped = scale_after < scale_before
            else:
                skipped = tf.constant(False)
            is_event = skipped | loss_nonfinite
            step = tf.convert_to_tensor(self.total_steps)
            keep = loss_nonfinite if self.loss_watched else tf.constant(True)
            if self.kind == SCALER_KERAS:
                keep |= skipped & self._at_trusted_scale(scale_after)
            keep_fn = lambda: keep  # noqa: E731

        def on_event():
            if saved_metrics is not None:
                # The skipped step's loss is left out of the epoch's averages.
                tf.cond(
                    skipped,
                    lambda: _restore(saved_metrics, self.left_out_steps),
                    lambda: tf.constant(0),
                )
            if self.ring is not None:
                self.ring.write(
                    self.event_count,
                    step,
                    scale_before,
                    scale_after,
                    loss_nonfinite,
                    loss_has_nan,
                )
                self.event_count.assign_add(1)
            if leaves is not None and not stash_by_select:
                tf.cond(
                    keep_fn(),
                    lambda: self._stash(leaves, step),
                    lambda: tf.constant(0),
                )
            return tf.constant(0)

        tf.cond(is_event, on_event, lambda: tf.constant(0))
        left_out = skipped if saved_metrics is not None else tf.constant(False)
        if leaves is not None and not stash_by_select:
            return None, step, left_out  # decided in the event branch
        keep = is_event & keep_fn()
        if stash_by_select:
            self._stash_selected(leaves, step, keep)
        return keep, step, left_out

    def _scaler_loss_not_finite(self):
        """Return True unless our scaler saw the skipped step's loss finite.

        Read from its newest record (just written for this step); a loss it
        never saw (a custom `train_step` without `scale_loss`) counts as not
        finite, so that step's batch is kept for the replay.
        """
        state = _overflow_records.newest_loss_state(self.optimizer)
        return tf.not_equal(state, _overflow_record.LOSS_FINITE)

    def _at_trusted_scale(self, scale_after=None):
        """Return True when the scale after the step is at most the trusted one.

        The scale after a skipped step is at most the scale it ran with, so
        this keeps every batch skipped at a trusted scale (and a few more).
        """
        if scale_after is None:
            scale_after = self._read_scale_of_our_scaler()
        return scale_after <= self.trusted_backward_scale

    def _read_scale_of_our_scaler(self):
        return tf.cast(_compat.current_loss_scale(self.optimizer), tf.float32)

    def _stash(self, leaves, step):
        """Keep the batch of a forward overflow for the replay (if it fits)."""
        self._note_bad_batch(_holds_non_finite(leaves), step)
        fits = self._batch_fits(leaves)

        def write_stash():
            for buffer, tensor in zip(self._stash_variables, leaves, strict=True):
                buffer.write(tensor)
            self.stash_step.assign(step)
            return tf.constant(0)

        return tf.cond(fits, write_stash, lambda: tf.constant(0))

    def _stash_selected(self, leaves, step, keep):
        """`_stash` as selects: the buffers take the batch where `keep` holds."""
        self._note_bad_batch(keep & _holds_non_finite(leaves), step)
        keep &= self._batch_fits(leaves)
        for buffer, tensor in zip(self._stash_variables, leaves, strict=True):
            buffer.write_where(keep, tensor)
        self.stash_step.assign(tf.where(keep, step, self.stash_step))

    def _note_bad_batch(self, bad, step):
        """Add `step` to the bad batches' ring where the scalar `bad` holds."""
        slot = self._bad_batch_count % self.capacity
        current = tf.gather(tf.convert_to_tensor(self._bad_batch_ring), slot)
        _put(self._bad_batch_ring, slot, tf.where(bad, step, current))
        self._bad_batch_count.assign_add(tf.cast(bad, tf.int64))

    def _batch_fits(self, leaves):
        """Return a boolean tensor: True when every leaf fits in its buffer."""
        fits = tf.constant(True)
        for buffer, tensor in zip(self._stash_variables, leaves, strict=True):
            fits &= buffer.fits(tensor)
        return fits

    def _stash_leaves(self, data):
        """Return the batch's tensors; create their stash buffers on first use."""
        flat = tf.nest.flatten(data)
        leaves = [tf.convert_to_tensor(t) for t in flat if t is not None]
        signature = [(t.dtype, t.shape.rank) for t in leaves]
        if (
            self._stash_variables is None
            or [(b.dtype, b.rank) for b in self._stash_variables] != signature
        ):
            context = tf.distribute.get_replica_context()
            if tf.distribute.has_strategy() and context is not None:
                # Replicas trace in their own threads: one merge_call creates
                # the buffers once, mirrored, in cross-replica context.
                context.merge_call(lambda _: self._create_stash(leaves))
            else:
                self._create_stash(leaves)
        self._stash_structure = (data, [t is None for t in flat])
        return leaves

    def _create_stash(self, leaves):
        # Lifted out of the traced function: created once, eagerly.
        with tf.init_scope(), self.strategy.scope():
            self._stash_variables = [_StashBuffer(t) for t in leaves]

    # -- host side ---------------------------------------------------------------
    def stashed_batches(self):
        """Return `(step, [data])` of the last overflow step, or `(0, [])`.

        One batch per local replica: under `MirroredStrategy` each replica
        stashed its own share of the step's batch, and only some of them may
        have overflowed.
        """
        step = int(self.stash_step.numpy())
        if step == 0 or self._stash_variables is None:
            return 0, []
        structure, is_none = self._stash_structure
        per_buffer = [b.read_replicas(self.strategy) for b in self._stash_variables]
        batches = []
        for replica_values in zip(*per_buffer, strict=True):
            values = iter(replica_values)
            flat = [None if none else next(values) for none in is_none]
            batches.append(tf.nest.pack_sequence_as(structure, flat))
        return step, batches

    def bad_batch_steps(self) -> set[int]:
        """Return the steps (of the last `capacity`) whose kept batch held Inf/NaN.

        Any local replica's share: under `MirroredStrategy` each checked its own.
        """
        steps = set()
        for ring in self.strategy.experimental_local_results(self._bad_batch_ring):
            steps.update(int(step) for step in ring.numpy() if step > 0)
        return steps

    def read_records(self, since_count: int) -> tuple[list[OverflowRecord], int]:
        """Return the events recorded after the `since_count`-th and the new count.

        Only with Keras's scaler or none (our scaler records its own events).
        Events older than the ring buffer's capacity are gone: then fewer than
        `count - since_count` events are returned.
        """
        count = int(self.event_count.numpy())
        if count <= since_count:
            return [], count
        first = max(since_count, count - self.capacity)
        records = self.ring.read(first, count, self.loss_watched)
        return records, count

    def restore_counters(self, total_steps: int, event_count: int) -> None:
        """Set the counters after a resume so step numbers continue exactly.

        The bad batches' ring is emptied: a resumed epoch runs its steps, and
        their numbers, again.
        """
        self.total_steps.assign(total_steps)
        self.event_count.assign(event_count)
        self._bad_batch_ring.assign(tf.zeros_like(self._bad_batch_ring))
        self._bad_batch_count.assign(0)


class _EventRing:
    """The last `capacity` events seen without our scaler, in graph variables.

    Every update has a static shape (one-slot `tensor_scatter_nd_update`).
    """

    def __init__(self, capacity):
        self.capacity = capacity
        self.steps = _variable("amp_monitor_event_steps", [capacity], tf.int64)
        self.scales_before = _variable(
            "amp_monitor_scales_before", [capacity], tf.float32
        )
        self.scales_after = _variable(
            "amp_monitor_scales_after", [capacity], tf.float32
        )
        self.loss_nonfinite = _variable(
            "amp_monitor_loss_nonfinite", [capacity], tf.int64
        )
        self.loss_has_nan = _variable("amp_monitor_loss_has_nan", [capacity], tf.int64)

    def write(self, count, step, scale_before, scale_after, nonfinite, has_nan):
        """Write event number `count + 1` (0-based `count`) into its slot."""
        slot = count % self.capacity
        _put(self.steps, slot, step)
        _put(self.scales_before, slot, scale_before)
        _put(self.scales_after, slot, scale_after)
        _put(self.loss_nonfinite, slot, nonfinite)
        _put(self.loss_has_nan, slot, has_nan)

    def read(self, first, count, loss_watched) -> list[OverflowRecord]:
        """Return events `first + 1 .. count` as records (host side)."""
        slots = [index % self.capacity for index in range(first, count)]
        steps = self.steps.numpy()[slots]
        before = self.scales_before.numpy()[slots]
        after = self.scales_after.numpy()[slots]
        nonfinite = self.loss_nonfinite.numpy()[slots]
        has_nan = self.loss_has_nan.numpy()[slots]
        return [
            OverflowRecord(
                index=index + 1,
                step=int(steps[i]),
                scale_before=_finite_or_none(before[i]),
                scale_after=_finite_or_none(after[i]),
                has_nan=bool(has_nan[i]),
                loss_finite=not nonfinite[i] if loss_watched else None,
            )
            for i, index in enumerate(range(first, count))
        ]


class _StashBuffer:
    """A fixed-size flat buffer holding one tensor of any shape up to a size.

    XLA cannot change a variable's shape, so a batch is stored flattened at
    the start of a 1-D buffer, with its shape beside it. The size is the
    element count the batch had when the step was first traced (Keras traces
    the first, full batch with static shapes); a larger batch is not stored.
    """

    DEFAULT_SIZE = 1 << 16

    def __init__(self, example):
        self.dtype = example.dtype
        self.rank = example.shape.rank
        size = example.shape.num_elements()
        self.size = max(int(size), 1) if size is not None else self.DEFAULT_SIZE
        self.values = _variable("amp_monitor_stash", [self.size], self.dtype)
        self.shape = _variable("amp_monitor_stash_shape", [self.rank], tf.int64)

    def fits(self, tensor):
        """Return a boolean tensor: True when `tensor` fits in the buffer."""
        return tf.size(tensor, out_type=tf.int64) <= self.size

    def write(self, tensor):
        """Store `tensor` (call only when `fits(tensor)`)."""
        self.values.assign(self._padded(tensor))
        self.shape.assign(tf.shape(tensor, out_type=tf.int64))

    def write_where(self, condition, tensor):
        """Store `tensor` where the scalar `condition` holds, else keep the old.

        `tensor` must fit unless `condition` is False.
        """
        if not self._fits_statically(tensor):
            return  # a larger batch, known at trace time: never stored
        self.values.assign(tf.where(condition, self._padded(tensor), self.values))
        shape = tf.shape(tensor, out_type=tf.int64)
        self.shape.assign(tf.where(condition, shape, self.shape))

    def _fits_statically(self, tensor):
        size = tensor.shape.num_elements()
        return size is None or size <= self.size

    def _padded(self, tensor):
        """Return the flat tensor, then zeros up to the buffer's size."""
        flat = tf.reshape(tensor, [-1])
        padding = tf.maximum(self.size - tf.size(flat), 0)
        return tf.concat([flat, tf.zeros([padding], self.dtype)], 0)[: self.size]

    def read_replicas(self, strategy):
        """Return the stored tensor of each local replica (host side)."""
        values = strategy.experimental_local_results(self.values)
        shapes = strategy.experimental_local_results(self.shape)
        return [
            _read_flat(value, shape)
            for value, shape in zip(values, shapes, strict=True)
        ]


def _read_flat(values, shape):
    shape = shape.numpy()
    count = int(np.prod(shape)) if len(shape) else 1
    return tf.reshape(tf.convert_to_tensor(values)[:count], shape)


class _CallOrder:
    """Record, while the step is traced, the order the leaf layers are called.

    Pure Python around each layer's `call` (an instance attribute, removed on
    exit): it adds nothing to the traced graph. Replicas of a MirroredStrategy
    trace in their own threads, interleaved: only one records at a time.
    """

    _active = set()
    _lock = threading.Lock()

    def __init__(self, model):
        self.model = model
        self.layers = []
        self._originals = []

    def __enter__(self):
        if not tf.inside_function():
            return self
        with self._lock:
            if id(self.model) in self._active:
                return self
            self._active.add(id(self.model))
        self._owner = True
        for layer in _leaf_layers(self.model):
            self._originals.append((layer, layer.__dict__.get("call")))
            layer.call = self._wrap(layer, layer.call)
        return self

    def _wrap(self, layer, original):
        def recorded_call(*args, **kwargs):
            if not any(seen is layer for seen in self.layers):
                self.layers.append(layer)
            return original(*args, **kwargs)

        return recorded_call

    def __exit__(self, *exc_info):
        for layer, previous in self._originals:
            if previous is None:
                layer.__dict__.pop("call", None)
            else:
                layer.call = previous
        self._originals = []
        if getattr(self, "_owner", False):
            with self._lock:
                self._active.discard(id(self.model))
        return False


def _leaf_layers(model):
    return [layer for layer in candidate_layers(model) if not _has_sublayers(layer)]


def _has_sublayers(layer):
    return any(
        not isinstance(sub, keras.layers.InputLayer)
        for sub in _compat.direct_sublayers(layer)
    )


def _holds_non_finite(leaves):
    """Return a boolean tensor: True when a floating leaf holds Inf or NaN."""
    non_finite = tf.constant(False)
    for tensor in leaves:
        if tensor.dtype.is_floating:
            non_finite |= tf.reduce_any(~tf.math.is_finite(tensor))
    return non_finite


def _finite_or_none(value):
    value = float(value)
    return value if np.isfinite(value) else None

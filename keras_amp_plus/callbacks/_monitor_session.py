"""One `fit` as seen by `AMPMonitor`: instrumentation, reads, writes, resume.

`MonitorSession.__init__` runs in `on_train_begin` and does every check of
`keras_amp_plus.callbacks._checks` before it touches the model. The session
reads the monitor's settings; what the monitor knows across `fit` calls (its
state, lists and rule) it changes only through the `MonitorMemory` it is given.
"""

import copy
import functools
import json
import logging
import zlib

from keras_amp_plus import _compat
from keras_amp_plus._lists import layer_names
from keras_amp_plus._lists.precision_lists import PrecisionLists
from keras_amp_plus.callbacks import _checks as checks
from keras_amp_plus.callbacks import _distribution as distribution
from keras_amp_plus.callbacks import _state as state_module
from keras_amp_plus.callbacks import _unfinished_fits as unfinished_fits
from keras_amp_plus.callbacks._adaptation import Decision
from keras_amp_plus.callbacks._attribution import OUTPUT_OUTSIDE_ITS_POLICY, LayerIndex
from keras_amp_plus.callbacks._event_collector import (
    LOSS_STAYED_FINITE,
    EventCollector,
)
from keras_amp_plus.callbacks._event_log import (
    EventLog,
    changes_markdown,
    highest_run,
)
from keras_amp_plus.callbacks._list_editor import ListEditor
from keras_amp_plus.callbacks._step_recorder import (
    SCALER_KAP,
    SCALER_NONE,
    StepRecorder,
)
from keras_amp_plus.optimizers import LossScaleOptimizer, _scale_schedule

logger = logging.getLogger("keras_amp_plus")

GUARD_ADVICE = (
    "AMPMonitor: the loss was Inf/NaN on %d step(s) of epoch %d and no loss "
    "scale optimizer skipped them, so the weights were updated with non-finite "
    "gradients. Wrap the optimizer in the guard mode, "
    "`keras_amp_plus.optimizers.LossScaleOptimizer.guard(optimizer)`: it skips "
    "and records every non-finite step (scale fixed at 1, free for bfloat16)."
)

DENIAL_WITHOUT_EFFECT = (
    "AMPMonitor epoch %d: layer %r is on the deny list and its forward pass "
    "still overflows (%s)%s. %s"
)
# Why, by the replay's reason.
CAST_OUTSIDE_THE_LAYER = (
    "A denial cannot reach a cast Keras makes outside the layer's dtype "
    "policy, at the boundary of the model around it: a subclassed "
    "`keras.Model` created under `mixed_float16` casts its inputs to float16 "
    "in its own `__call__`, and a nested `keras.Sequential` built without "
    "`keras.Input` casts them to the compute dtype its first layer had when "
    "it was built, whatever its layers' policies are now. Create the "
    'subclassed model with `dtype="float32"` (its layers keep their own '
    "policies), start the nested `Sequential` with `keras.Input(shape)`, or "
    "bring the inputs into the 16-bit range before the model (e.g. rescale "
    "them in the input pipeline)."
)
POLICY_OUT_OF_REACH = (
    "Its Keras dtype policy computes it in 16 bits, which the engine's op "
    "lists cannot change. Use engine='keras' for a model with a mixed policy."
)
VARIABLES_IN_16_BITS = (
    "Its variables are 16-bit (a pure dtype policy), and Keras has no policy "
    "computing such a layer in float32, so the denial left it in 16 bits. "
    "Train under 'mixed_float16' or 'mixed_bfloat16' (float32 variables)."
)
POLICY_NOT_APPLIED = (
    "It computes in 16 bits whatever its own policy says: the layer around it "
    "runs it by its `call` method, under that layer's policy. Deny the layer "
    "around it instead."
)
OVERFLOW_IN_FLOAT32 = (
    "Its output is not finite in float32 either: the values themselves "
    "diverge, which no precision fixes. Check the inputs, lower the learning "
    "rate or clip the gradients."
)

NAN_VALIDATION = (
    "AMPMonitor epoch %d: validation gave NaN, and these results read their "
    "worst values: %s (%s). Callbacks read `inf` for a loss, `-inf` for an "
    "accuracy (also one measured on the NaN outputs of a NaN loss), so "
    "`EarlyStopping` and `ModelCheckpoint(save_best_only=True)` do not keep "
    "it for the best (Keras 3's take a first NaN for the best forever)."
)
# Why, by the epoch's training steps.
VALIDATED_BEFORE_ADAPTING = (
    "its %d overflow event(s) in training: validation ran on the model as the "
    "epoch's steps left it, before the epoch's end, where the monitor may move "
    "layers"
)
NAN_WITHOUT_OVERFLOWS = (
    "no overflow in its training steps: check the validation data for Inf "
    "or NaN, and the model for values that diverge"
)


class StepCache:
    """The instrumented train function of the last `fit`, for the next one.

    Tracing the whole step again costs seconds on a large model; a loop that
    calls `fit` repeatedly with the same monitor reuses it as long as the
    model was not recompiled (Keras then makes a new train function) and the
    lists did not change (the engine then rebuilds it).

    Args:
        model: the model.
        recorder: its `StepRecorder` (the traced step writes its variables).
        plain_function: the uninstrumented train function left on the model.
        wrapped_function: the instrumented one.
    """

    def __init__(self, model, recorder, plain_function, wrapped_function):
        self.model = model
        self.optimizer = model.optimizer
        self.recorder = recorder
        self.plain_function = plain_function
        self.wrapped_function = wrapped_function

    def fits(self, model, capacity, monitor) -> bool:
        """Return True when the cached step is valid for this `fit`."""
        return (
            self.model is model
            and self.optimizer is model.optimizer
            and model.train_function is self.plain_function
            and self.recorder.capacity == capacity
            and self.recorder.exclude_skipped_steps == monitor.exclude_skipped_steps
            and self.recorder.trusted_backward_scale == monitor.trusted_backward_scale
            and self.recorder.compiles_model_step
            == self.recorder.can_compile_model_step()
        )


class MonitorSession:
    """One `fit` call as the monitor sees it (see module doc).

    Args:
        monitor: the `AMPMonitor` (its settings are read, never written).
        model: the model being trained.
        memory: the monitor's `MonitorMemory`.
        step_cache: the `StepCache` of the monitor's previous `fit`, or None.
    """

    def __init__(self, monitor, model, memory, step_cache=None):
        # Before anything is checked or installed: a graph engine's switches
        # and this model's wrappers must be those of no earlier `fit`.
        unfinished_fits.end_those_left_behind(model)
        self.fit_frame = None  # the frame of the `fit` it runs in (`begin`)
        self.monitor = monitor
        self.model = model
        self.memory = memory
        self.engine = checks.check_fit_setup(monitor, model)
        optimizer = model.optimizer
        capacity = (
            optimizer.event_buffer_size
            if isinstance(optimizer, LossScaleOptimizer)
            else checks.DEFAULT_CAPACITY
        )
        self.read_every = monitor.read_every_steps or capacity
        checks.check_read_interval(self.read_every, model.steps_per_execution, capacity)
        if not _compat.optimizer_built(optimizer):
            # The scaler's variables are read by the wrapped step from its
            # first trace on; `BackupAndRestore` builds it the same way.
            optimizer.build(model.trainable_variables)
        self.index = LayerIndex(model)
        cache = step_cache
        if cache is not None and cache.fits(model, capacity, monitor):
            # Nothing changed since the last `fit`: reuse the traced step.
            self.recorder = cache.recorder
            self.recorder.install()
            model.train_function = cache.wrapped_function
        else:
            self.recorder = StepRecorder(
                model,
                capacity,
                monitor.exclude_skipped_steps,
                monitor.trusted_backward_scale,
            )
            self.recorder.install()
            # `fit` built its train function before `on_train_begin`;
            # rebuilding it (not deleting it) makes the next step trace
            # through the wrappers.
            model.make_train_function(force=True)
        self.recorder.on_abort = self.abort
        self.recorder.on_unfinished_fit = functools.partial(
            unfinished_fits.end_late, self
        )
        self.collector = EventCollector(
            model, self.recorder, self.index, memory.rule, monitor.replay
        )
        self.editor = ListEditor(self.engine, self.index)
        # Under a multi-worker strategy only the chief writes into log_dir;
        # every worker reads the chief's state file when a job resumes.
        self.strategy = model.distribute_strategy
        self.write_dir = (
            monitor.log_dir if distribution.is_chief(self.strategy) else None
        )
        self.log = EventLog(self.write_dir)
        self.started = False
        self.epoch = 0
        self.epoch_events = []
        # Whether the epoch's first step moves back the layers that earned
        # low precision back at an earlier epoch end (`_defer_returns`).
        self.returns_due = False
        # `(lists, pending returns, editor state)` before this epoch's first
        # step moved layers back: what an abort in the epoch goes back to.
        self._before_returns = None
        self._written_scalars = None
        self.snapshots = {}
        self._say_epoch_reads(True)
        unfinished_fits.begin(self)

    def _say_epoch_reads(self, reading: bool) -> None:
        """Tell our scaler whether the monitor reads it every epoch (this `fit`)."""
        optimizer = self.model.optimizer
        if isinstance(optimizer, LossScaleOptimizer):
            _scale_schedule.read_each_epoch(optimizer, reading)

    # -- start / resume ----------------------------------------------------------
    def start(self, epoch: int) -> None:
        """Continue the monitor's record at `epoch` (resume or fresh start)."""
        memory = self.memory
        if not memory.watch(self.model) and memory.state.epoch >= 0:
            # This monitor's last `fit` trained another model (a callbacks
            # list reused for the next experiment, or a reloaded copy): its
            # lists name that model's layers. This model starts a run of its
            # own, from the monitor's own lists; a reloaded copy that still
            # runs the lists continues them (`_model_keeps_lists_of`).
            memory.start_over()
        state, continuing = self._record_to_continue(epoch)
        lists = json.dumps(state.lists, sort_keys=True).encode()
        distribution.check_same_record(
            self.strategy,
            [
                continuing,
                state.epoch + 1,
                state.run,
                state.total_steps,
                zlib.crc32(lists),
            ],
            self.monitor.log_dir,
        )
        # What an abort in this fit's first epoch goes back to: the record
        # as the last completed epoch left it, before the renumbering below.
        self._epoch_end_state = copy.deepcopy(state)
        if epoch <= state.epoch:
            # The same monitor in a new `fit` that numbers epochs from 0 again.
            state.epoch_offset += state.epoch + 1 - epoch
        memory.resume(state)
        self.editor.set_state(state.adaptation.get("editor", {}))
        self.recorder.restore_counters(state.total_steps, state.recorder_events)
        # Our scaler's counts are its own: a reloaded earlier checkpoint, an
        # optimizer reused or another model's may be behind or ahead of the
        # record. Its events from now on are new, numbered as the record's.
        state.scaler_events = self._scaler_count()
        self.collector.set_cursors(
            state.recorder_events,
            state.scaler_events,
            scaler_step_shift=state.total_steps - self._scaler_steps(),
        )
        # A new run appends; a resumed one cuts the interrupted epoch's lines.
        self.log.open(keep_lines=state.jsonl_lines if continuing else None)
        # A graph engine switches its rewrite on even with empty lists.
        self.engine.start(self.model, memory.lists)
        if not self._returns_to_apply():
            # Else the first step's moves write the lists (`_apply_pending_returns`).
            self._log_lists(state.epoch_offset + epoch)
        self.started = True

    def _record_to_continue(self, epoch: int) -> tuple:
        """Return `(state, continuing)`: the record this `fit` continues.

        The monitor's own (a later `fit`), the state file's snapshot of
        epoch `epoch - 1` (a `fit` resumed by `BackupAndRestore`), else a new
        run numbered after the state file's last one and after every run in
        the events file. The state file is left as it is until this run's
        first epoch ends, or the run stops in it (`_save_stopped_first_epoch`):
        a crash before that must not lose the earlier runs' numbering.
        """
        state = self.memory.state
        snapshots = state_module.load_snapshots(self.monitor.log_dir)
        if state.epoch >= 0:
            continuing = True
        elif epoch > 0 and snapshots.get(epoch - 1) is not None:
            state, continuing = snapshots[epoch - 1], True
            logger.info("AMPMonitor: resuming the record of epoch %d.", epoch - 1)
        else:
            continuing = False
            if snapshots:
                self._continue_after(state, snapshots[max(snapshots)], epoch)
            # After any run whose lines are there, saved state or not.
            state.run = max(state.run, highest_run(self.monitor.log_dir) + 1)
            snapshots = {}  # the first save replaces the earlier runs' file
        self.snapshots = {e: s.to_dict() for e, s in snapshots.items()}
        return state, continuing

    def _continue_after(self, state, previous, epoch: int) -> None:
        """Give `state` the numbers of a run after `previous`, the log_dir's last.

        A new run number; TensorBoard steps and epochs continue after its.
        """
        state.run = previous.run + 1
        state.step_offset = previous.step_offset + previous.total_steps
        state.epoch_offset = previous.epoch_offset + previous.epoch + 1 - epoch
        state.run_epoch_offset = state.epoch_offset
        # One cumulative series on one TensorBoard step axis; the scale's
        # series goes on from its last point, not from that point again.
        state.skipped_steps = previous.skipped_steps
        state.last_scale_point = previous.last_scale_point
        if self._model_keeps_lists_of(previous):
            state.lists = previous.lists
            state.adaptation = previous.adaptation
            logger.info(
                "AMPMonitor: continuing the lists of run %d of this log_dir, "
                "which the model's dtype policies still carry: %s",
                previous.run,
                PrecisionLists.from_config(previous.lists),
            )

    def _scaler_count(self) -> int:
        if self.recorder.kind != SCALER_KAP:
            return 0
        return int(self.model.optimizer.overflow_count.numpy())

    def _model_keeps_lists_of(self, previous) -> bool:
        """Return True when the model still runs the layer lists `previous` left.

        A model trained again (the same object, or reloaded from a `.keras`
        file) into the same `log_dir` keeps the dtype policies an earlier
        monitor gave its layers; a new monitor without lists of its own then
        continues that one's lists and memory (so a denied layer can still
        move back), instead of logging empty lists while layers run in
        float32. That is when every layer the earlier deny list names is in
        this model and computes in float32 (another experiment's model into
        the same `log_dir` is not continued). Graph engines' op lists live
        only while a monitor runs: nothing to continue.
        """
        lists = PrecisionLists.from_config(previous.lists)
        if (
            self.engine.level != "layer"
            or not lists.deny_layers
            or self.memory.lists != PrecisionLists()
        ):
            return False
        try:
            decisions = layer_names.layer_decisions(
                self.model, lists.allow_layers, lists.deny_layers
            )
        except ValueError:  # an entry names no layer of this model
            return False
        return all(
            layer.compute_dtype == "float32"
            for layer, kind in decisions.values()
            if kind == "deny"
        )

    def _scaler_steps(self) -> int:
        """Return our scaler's step count (the record's own without it)."""
        if self.recorder.kind != SCALER_KAP:
            return int(self.recorder.total_steps.numpy())
        return int(self.model.optimizer.total_steps.numpy())

    # -- per step / per epoch ----------------------------------------------------
    def begin_epoch(self, epoch: int) -> None:
        """Start or resume the record (first epoch); reset the epoch's counters.

        A start that fails (a damaged state file, lists the engine refuses)
        gives the model its own step back before the error propagates:
        Keras calls no `on_train_end` then.
        """
        if not self.started:
            try:
                self.start(epoch)
            except BaseException:
                self.abort()
                raise
        self.recorder.begin_epoch()
        # A validation stopped by Ctrl-C never reached `on_test_end`.
        self.recorder.validating = False
        self.recorder.nan_validation_metrics.clear()
        self.epoch = epoch
        self.returns_due = self._returns_to_apply()
        self._before_returns = None
        self.epoch_events = []
        self.read_at = 0

    def before_batch(self, batch: int) -> None:
        """Move layers back at an epoch's first step; read the records.

        Called as batch `batch` begins, when steps `0 .. batch - 1` of the
        epoch are done. The records are read when `read_every` steps
        finished since the last read.
        """
        if self.returns_due:
            self.returns_due = False
            try:
                self._apply_pending_returns(self.epoch)
            except BaseException:
                self.abort()  # Keras calls no `on_train_end` then
                raise
        if batch - self.read_at >= self.read_every:
            try:
                self.epoch_events.extend(self.drain())
            except BaseException:
                self.abort()  # Keras calls no `on_train_end` then
                raise
            self.read_at = batch

    def drain(self, force_scalars: bool = False, agree: bool = True) -> list:
        """Read, attribute and write the events since the last read.

        The step scalars are written when they changed (or when forced, at the
        end of an epoch): most reads find nothing new and cost one host read.
        `agree=False` keeps this worker's own verdicts (no collective: a
        stopped `fit`'s other workers may not come).
        """
        events = self.collector.collect(self.record_epoch(self.epoch))
        if agree:
            # Each worker replayed its own batch: every worker takes the union.
            distribution.agree_on_layers(
                self.strategy, events, list(self.index.by_path)
            )
        state = self.memory.state
        rule = self.memory.rule
        for event in events:
            event["trusted"] = rule.is_trusted(event)
            event["run"] = state.run
            logger.debug("AMPMonitor overflow event: %s", event)
            self._note_forward_scale(event)
            self._scale_points(event)
        self.log.write_records(events)
        state.skipped_steps += len(events)
        values = (self.loss_scale(), state.skipped_steps)
        if force_scalars or values != self._written_scalars:
            self._written_scalars = values
            step = self.tensorboard_step()
            self._scale_point(values[0], step)
            self.log.scalars({self._steps_tag(): values[1]}, step=step)
        return events

    def _scale_point(self, value, step: int) -> None:
        """Write `amp/loss_scale` at `step`, keeping the series in step order.

        A point before the last one written, or that point again, would draw
        TensorBoard's line back and forth. A point at the last step with a new
        value is written: a scale put back at an epoch's end is the scale
        after that epoch's last step, the value the next step starts from
        (TensorBoard reads the last point of a step).
        """
        state = self.memory.state
        # Kept in the state: the run's next `fit` continues the same series.
        last = state.last_scale_point
        if value is None or (last is not None and step < last[0]):
            return
        if [step, value] == last:
            return
        state.last_scale_point = [step, value]
        self.log.scalars({"amp/loss_scale": value}, step=step)

    def _log_lists(self, step: int, lists: PrecisionLists | None = None) -> None:
        """Write `amp/lists` (default: those in force) at `step`, unless there already.

        A `fit` resumed or continued at the epoch after a change finds the
        new lists written at its first epoch.
        """
        lists = self.memory.lists if lists is None else lists
        logged = [step, json.dumps(lists.get_config(), sort_keys=True)]
        if self.memory.state.lists_logged == logged:
            return
        self.memory.state.lists_logged = logged
        self.log.text("amp/lists", lists.to_markdown(), step)

    def record_epoch(self, epoch: int) -> int:
        """Return the run's number of this `fit`'s `epoch` (for the records).

        A monitor's further `fit`s of the same model continue its run, and
        their epochs continue its numbering, as TensorBoard's per-epoch
        scalars do: `(run, epoch)` names one epoch.
        """
        state = self.memory.state
        return state.epoch_offset - state.run_epoch_offset + epoch

    def tensorboard_step(self, step: int | None = None) -> int:
        """Return the TensorBoard step of train step `step` (default: the last)."""
        if step is None:
            step = int(self.recorder.total_steps.numpy())
        return self.memory.state.step_offset + step

    def _scale_points(self, event) -> None:
        """Put the scale before and after an event on `amp/loss_scale`."""
        before, after = event["scale_before"], event["scale_after"]
        if before is None or after is None or before == after:
            return
        step = self.tensorboard_step(event["step"])
        self._scale_point(before, step - 1)
        self._scale_point(after, step)

    def _scales_before_forward(self) -> dict:
        """`{layer: scale}`: the scale before each layer's forward overflows."""
        adaptation = self.memory.state.adaptation
        if not isinstance(adaptation.get("scale_before_forward"), dict):
            adaptation["scale_before_forward"] = {}  # a state file's older form
        return adaptation["scale_before_forward"]

    def _note_forward_scale(self, event) -> None:
        """Remember the scale to put back if a layer overflowing forward is denied.

        The scale before its first forward overflow, at most the scale the
        scaler went to after each backward overflow since: a gradient that
        overflowed at a scale says that scale is too high, which a denial
        does not undo.
        """
        scales = self._scales_before_forward()
        before, after = event["scale_before"], event["scale_after"]
        if event["direction"] == "forward":
            if before is not None:
                for layer in event["layers"]:
                    scales.setdefault(layer, before)
            return
        if after is not None:
            for layer in scales:
                scales[layer] = min(scales[layer], after)

    def _forget_calm_layers(self, events) -> None:
        """Forget the scales of layers without a forward overflow this epoch.

        Their overflows stopped: a later one starts from the scale of its
        time, not from one the scaler has long since left for other reasons.
        """
        overflowing = {
            layer
            for event in events
            if event["direction"] == "forward"
            for layer in event["layers"]
        }
        scales = self._scales_before_forward()
        for layer in [layer for layer in scales if layer not in overflowing]:
            del scales[layer]

    def restore_scale(self, epoch: int, denied_layers) -> None:
        """Put the scale back where it was before the denied layers' overflows.

        A forward overflow is no sign the scale is too high, yet the scaler
        halves it at each one; once the layer is denied the scale would need
        thousands of clean steps to grow back. The scales the scaler went to
        for backward overflows since stay (`_note_forward_scale`).

        Args:
            epoch: the epoch that ended.
            denied_layers: the layers just moved to the deny list.
        """
        scales = self._scales_before_forward()
        targets = [scales.pop(layer) for layer in denied_layers if layer in scales]
        if not targets or not self.has_scaler():
            return
        target = max(targets)
        optimizer = self.model.optimizer
        if isinstance(optimizer, LossScaleOptimizer):
            target = min(target, optimizer.max_scale)
        current = self.loss_scale()
        if target <= current:
            return
        scale, counter = _compat.loss_scale_variables(optimizer)
        scale.assign(target)
        counter.assign(0)
        step = self.tensorboard_step()
        # Both at the epoch's last step: the next step, whether it overflows
        # or not, starts from `target`.
        self._scale_point(current, step)
        self._scale_point(target, step)
        self.log.write_record(
            {
                "type": "scale_restored",
                "epoch": self.record_epoch(epoch),
                "run": self.memory.state.run,
                "from": current,
                "to": target,
            }
        )
        logger.warning(
            "AMPMonitor epoch %d: loss scale put back from %s to %s: the scaler "
            "backed it off for the forward overflows of the layers just denied, "
            "which were no sign it was too high (not above its scale after a "
            "backward overflow since).",
            self.record_epoch(epoch),
            current,
            target,
        )

    def _steps_tag(self) -> str:
        """Return the tag of the cumulative event steps (applied without a scaler)."""
        return "amp/skipped_steps" if self.has_scaler() else "amp/nonfinite_steps"

    def has_scaler(self) -> bool:
        """Return True when a loss scaler (ours or Keras's) wraps the optimizer."""
        return self.recorder.kind != SCALER_NONE

    def loss_scale(self):
        """Return the current loss scale, or None without a scaler."""
        if self.recorder.kind == SCALER_NONE:
            return None
        return float(_compat.current_loss_scale(self.model.optimizer).numpy())

    def report_epoch(self, epoch, events, steps, evidence) -> None:
        """Write the per-epoch scalars and log what the scaler and layers did.

        `evidence` holds only the events attributed to a layer at a trusted
        scale; backward overflows above `trusted_backward_scale` are the
        scaler still searching for its scale and are reported as that.
        """
        # The ITEX engine reads its rewrite log (when one is set) to notice a
        # rewrite that silently did not happen.
        self.engine.check_rewrites()
        state = self.memory.state
        seen = state.adaptation.setdefault("overflowed_layers", [])
        seen.extend(layer for layer in sorted(evidence) if layer not in seen)
        searching = [e for e in events if not e.get("trusted", True)]
        values = {
            "amp/overflow_events": len(events),
            "amp/overflow_rate": len(events) / steps if steps else 0.0,
            "amp/scale_search_overflows": len(searching),
        }
        values.update(
            {f"amp/overflow/{layer}": evidence.get(layer, 0) for layer in seen}
        )
        self.log.scalars(values, step=state.epoch_offset + epoch)
        if searching:
            logger.info(
                "AMPMonitor epoch %d: the loss scaler is still searching for its "
                "scale: %d backward overflow(s) at scales above "
                "trusted_backward_scale=%s (no evidence against any layer).",
                self.record_epoch(epoch),
                len(searching),
                self.monitor.trusted_backward_scale,
            )
        for layer, count in sorted(evidence.items()):
            forward = sum(
                1
                for e in events
                if layer in e["layers"] and e["direction"] == "forward"
            )
            logger.info(
                "AMPMonitor epoch %d: layer %r overflowed at a trusted scale: %d "
                "event(s) attributed (%d forward: its output exceeded the "
                "16-bit range, keep it in float32; %d backward: its gradients "
                "did, a lower learning rate or gradient clipping may help).",
                self.record_epoch(epoch),
                layer,
                count,
                forward,
                count - forward,
            )
        forward = [e for e in events if e["direction"] == "forward"]
        self._warn_denial_without_effect(epoch, forward)
        if (
            forward
            and self.recorder.kind == SCALER_NONE
            and not state.guard_recommended
        ):
            logger.warning(GUARD_ADVICE, len(forward), self.record_epoch(epoch))
            state.guard_recommended = True

    def _warn_denial_without_effect(self, epoch, forward_events) -> None:
        """Warn (once per layer) of forward overflows of a layer already denied."""
        denied = self.editor.denied_layers(self.model, self.memory.lists)
        state = self.memory.state
        warned = state.adaptation.setdefault("denials_without_effect", [])
        for event in forward_events:
            for layer in event["layers"]:
                if layer not in denied or layer in warned:
                    continue
                warned.append(layer)
                self.log.write_record(
                    {
                        "type": "denial_without_effect",
                        "epoch": self.record_epoch(epoch),
                        "run": state.run,
                        "layer": layer,
                        "evidence": event["evidence"],
                    }
                )
                logger.warning(
                    DENIAL_WITHOUT_EFFECT,
                    self.record_epoch(epoch),
                    layer,
                    event["evidence"],
                    ", so every such step is skipped" if self.has_scaler() else "",
                    self._why_denial_fails(layer, event),
                )

    def _why_denial_fails(self, layer_path: str, event) -> str:
        """Return why a denied layer's forward pass still overflows."""
        layer = self.index.by_path.get(layer_path)
        if layer is not None and checks.policy_out_of_reach(layer, self.engine):
            if self.engine.level == "op":
                return POLICY_OUT_OF_REACH
            return VARIABLES_IN_16_BITS
        verdict = event["evidence"].removesuffix(LOSS_STAYED_FINITE)
        if verdict.endswith("input_cast"):
            return CAST_OUTSIDE_THE_LAYER
        if verdict.endswith(OUTPUT_OUTSIDE_ITS_POLICY):
            return POLICY_NOT_APPLIED
        return OVERFLOW_IN_FLOAT32

    def adapt(self, epoch, evidence) -> list:
        """Apply the adaptation rule; return the list changes it decided.

        Denials take effect at once. A layer moved back is moved at the
        first step of the next epoch that runs one (`_defer_returns`), of
        this `fit` or the model's next: whatever a callback saves at this
        epoch end (a checkpoint) matches the state file, and the model a
        `fit` returns never holds a layer in the precision it overflowed
        in, untried.
        """
        memory = self.memory
        denied = self.editor.denied_layers(self.model, memory.lists)
        # Record epochs: the rule's memory (last return, clean epochs) spans
        # fits, which each number their epochs from 0.
        decisions = memory.rule.decide(self.record_epoch(epoch), evidence, denied)
        returns = [decision for decision in decisions if decision.to == "allow"]
        others = [decision for decision in decisions if decision.to != "allow"]
        changes = self._apply_decisions(epoch, others)
        return changes + self._defer_returns(epoch, returns)

    def _pending_returns(self) -> list:
        """Return the state's list of layers to move back (`_defer_returns`)."""
        return self.memory.state.adaptation.setdefault("pending_returns", [])

    def _returns_to_apply(self) -> bool:
        """Return whether layers wait to move back and the monitor adapts."""
        return self.monitor.adapt and bool(self._pending_returns())

    def _defer_returns(self, epoch: int, returns) -> list:
        """Keep `returns` for the next epoch's first step; return their changes.

        The changes are those the move will make (`ListEditor.apply` on a
        copy of its state), for `amp/changes` at this epoch, which decided
        them.
        """
        pending = self._pending_returns()
        waiting = {entry["layer"] for entry in pending}
        new = {decision.layer for decision in returns} - waiting
        for decision in returns:
            if decision.layer not in new:
                continue
            pending.append(
                {
                    "layer": decision.layer,
                    "reason": decision.reason,
                    "evidence": decision.evidence,
                    "run": self.memory.state.run,
                    "epoch": self.record_epoch(epoch),
                }
            )
            logger.info(
                "AMPMonitor epoch %d: layer %r earned low precision back (%s); "
                "it moves back at the next epoch's first step.",
                self.record_epoch(epoch),
                decision.layer,
                decision.reason,
            )
        changes = self._previewed_returns()[1] if new else []
        return [change for change in changes if change["layer"] in new]

    def _previewed_returns(self) -> tuple:
        """Return `(lists, changes)` the pending returns will make; change nothing."""
        saved = self.editor.get_state()
        lists, changes = self.memory.lists, []
        for decision in self._pending_decisions():
            lists, moved = self.editor.apply(lists, decision)
            for change in moved:
                change.update(
                    reason=f"{decision.reason} (from the next epoch's first step)",
                    evidence=decision.evidence,
                )
            changes.extend(moved)
        self.editor.set_state(saved)
        return lists, changes

    def _pending_decisions(self) -> list:
        return [
            Decision(entry["layer"], "allow", entry["reason"], entry["evidence"])
            for entry in self._pending_returns()
        ]

    def _apply_pending_returns(self, epoch: int) -> None:
        """Move back the layers `_defer_returns` kept, at `epoch`'s first step.

        Their `list_change` records name the epoch that decided them, as a
        denial's do; a run continuing an earlier run's lists names its own
        first epoch (the reason names the deciding run and epoch).
        """
        state = self.memory.state
        pending = state.adaptation["pending_returns"]
        self._before_returns = (
            self.memory.lists,
            copy.deepcopy(pending),
            self.editor.get_state(),
        )
        state.adaptation["pending_returns"] = []
        for entry in pending:
            reason, decided = entry["reason"], entry.get("epoch")
            if entry.get("run", state.run) != state.run or decided is None:
                reason += f" (decided by run {entry.get('run')} at its epoch {decided})"
                decided = self.record_epoch(epoch)
            decision = Decision(entry["layer"], "allow", reason, entry["evidence"])
            self._apply_decisions(epoch, [decision], decided)
        self._log_lists(state.epoch_offset + epoch)

    def _undo_returns(self) -> None:
        """Go back to the lists before this epoch's first step moved layers back.

        For a step that raised (`abort`): the model, the lists and the state
        saved for the next `fit` then hold the record of the last epoch end,
        the moves still pending; a `list_change` line says so.
        """
        if self._before_returns is None:
            return
        lists, pending, editor_state = self._before_returns
        self._before_returns = None
        self.memory.state.adaptation["pending_returns"] = pending
        self.editor.set_state(editor_state)
        if self.memory.lists == lists:
            return  # the moves never took effect
        self.memory.set_lists(lists)
        for entry in pending:
            self.log.write_record(
                {
                    "type": "list_change",
                    "epoch": self.record_epoch(self.epoch),
                    "run": self.memory.state.run,
                    "kind": "layer",
                    "name": entry["layer"],
                    "from": "allow",
                    "to": "deny",
                    "layer": entry["layer"],
                    "reason": "the fit stopped in the epoch that tried it; "
                    "the next fit tries it again",
                    "evidence": {},
                }
            )
        self.engine.apply(self.model, lists)

    def _log_changes(self, epoch: int, changes) -> None:
        """Write `changes` (decided at `epoch`'s end) to TensorBoard's text.

        Also the lists they put in force from the next epoch on (`amp/lists`),
        the layers to move back at its first step included.
        """
        if not changes:
            return
        step = self.memory.state.epoch_offset + epoch
        self.log.text("amp/changes", changes_markdown(changes), step)
        self._log_lists(step + 1, self._previewed_returns()[0])

    def _apply_decisions(self, epoch, decisions, record_epoch=None) -> list:
        """Move the layers of `decisions`, log each move; return the changes.

        `record_epoch` is the epoch the `list_change` records name (default:
        `epoch`'s record number).
        """
        if record_epoch is None:
            record_epoch = self.record_epoch(epoch)
        memory = self.memory
        lists = memory.lists
        changes = []
        for decision in decisions:
            lists, moved = self.editor.apply(lists, decision)
            for change in moved:
                change.update(reason=decision.reason, evidence=decision.evidence)
                self.log.write_record(
                    {
                        "type": "list_change",
                        "epoch": record_epoch,
                        "run": memory.state.run,
                        **change,
                    }
                )
                logger.warning(
                    "AMPMonitor epoch %d: %s %r moved from %s to %s (layer %s): %s.",
                    record_epoch,
                    change["kind"],
                    change["name"],
                    change["from"] or "no list",
                    change["to"] or "no list",
                    change["layer"],
                    decision.reason,
                )
            changes.extend(moved)
        if changes:
            memory.set_lists(lists)
            self.engine.apply(self.model, lists)
            denied = [c["layer"] for c in changes if c["to"] == "deny"]
            if denied:
                self.restore_scale(epoch, denied)
        return changes

    def begin_validation(self) -> None:
        """`fit` validates: its NaN results read as their worst values."""
        self.recorder.validating = self.recorder.installed

    def end_validation(self) -> None:
        """`fit`'s validation ended."""
        self.recorder.validating = False

    def _report_nan_validation(self, epoch: int, events) -> None:
        """Warn and record that the epoch's validation gave NaN results."""
        names = sorted(set(self.recorder.nan_validation_metrics))
        self.recorder.nan_validation_metrics.clear()
        if not names:
            return
        self.log.write_record(
            {
                "type": "nan_validation",
                "epoch": self.record_epoch(epoch),
                "run": self.memory.state.run,
                "metrics": [f"val_{name}" for name in names],
                "overflow_events": len(events),
            }
        )
        cause = (
            VALIDATED_BEFORE_ADAPTING % len(events) if events else NAN_WITHOUT_OVERFLOWS
        )
        metrics = ", ".join(f"val_{name}" for name in names)
        logger.warning(NAN_VALIDATION, self.record_epoch(epoch), metrics, cause)

    def end_epoch(self, epoch: int, logs: dict | None) -> None:
        """Report the epoch, adapt the lists, fill `logs`, save the state.

        On an error (an engine refusing the adapted lists), the model gets
        its own step back (`abort`) before the error propagates.
        """
        try:
            self._end_epoch(epoch, logs)
        except BaseException:
            self.abort()
            raise

    def _end_epoch(self, epoch: int, logs: dict | None) -> None:
        self.epoch_events.extend(self.drain(force_scalars=True))
        events = self.epoch_events
        steps = self.recorder.steps_in_epoch()
        memory = self.memory
        evidence = memory.rule.evidence(events)
        self.report_epoch(epoch, events, steps, evidence)
        self._report_nan_validation(epoch, events)
        if logs is not None:
            logs["overflow_events"] = len(events)
        if self.monitor.adapt:
            self._log_changes(epoch, self.adapt(epoch, evidence))
        self._forget_calm_layers(events)
        if logs is not None and self.loss_scale() is not None:
            # After `adapt`, which may have put the scale back.
            logs["loss_scale"] = self.loss_scale()
        self._snapshot(epoch)

    def _counters(self) -> dict:
        """Return the `MonitorState` counters of the record as it stands."""
        return {
            "total_steps": int(self.recorder.total_steps.numpy()),
            "recorder_events": self.collector.recorder_cursor,
            "scaler_events": self.collector.scaler_cursor,
            "jsonl_lines": self.log.lines_written,
        }

    def _snapshot(self, epoch: int) -> None:
        """Save everything a resumed `fit` needs."""
        state = self.memory.snapshot(epoch, self.editor.get_state(), **self._counters())
        self._epoch_end_state = copy.deepcopy(state)
        state_module.save_snapshot(self.write_dir, state, self.snapshots)
        self.log.flush()

    def abort(self) -> None:
        """Undo what `close` undoes when `fit` stops on an exception in a step.

        Keras calls no `on_train_end` then: the events recorded since the
        last read are read and written (`_report_unread`), the logs flushed,
        the model gets its own step back and a graph engine's rewrite is
        switched off, so later models of the process train as they would
        without the monitor. Nothing is kept for the next `fit` to reuse.
        Also where Keras stopped `fit` outside a step (`_unfinished_fits`),
        at the next sign of it; a session ends once.
        """
        if not unfinished_fits.finish(self):
            return
        self._report_unread()
        self.log.close()
        self._say_epoch_reads(False)
        self.recorder.on_abort = lambda: None
        self.recorder.uninstall()
        if self.engine.level == "op":
            self.engine.restore()  # rebuilds the model's functions
        else:
            self.model.make_train_function(force=True)

    def _report_unread(self) -> None:
        """Write the events of the steps since the last read (see `abort`).

        Then the record goes back to the end of the last completed epoch, as
        a resumed `fit` (`BackupAndRestore`) finds it in the state file: the
        monitor's next `fit`, resumed or not, continues from there and cuts
        these lines, as it does any interrupted epoch's.
        """
        if not self.started:
            return
        try:
            self._undo_returns()
            self.drain(force_scalars=True, agree=False)
            if self._epoch_end_state.epoch < 0:
                self._save_stopped_first_epoch()
        except Exception:  # the step's own error is the one to raise
            logger.exception(
                "AMPMonitor could not read the events of the interrupted epoch."
            )
        self.memory.resume(copy.deepcopy(self._epoch_end_state))

    def _save_stopped_first_epoch(self) -> None:
        """Save a run stopped in its first epoch as the state file's last one.

        Its lines stay in `amp_events.jsonl` and its points in TensorBoard,
        so the next run is numbered, and its steps placed, after it. Saved as
        epoch -1, which no resumed `fit` (from epoch 1 on) continues from.
        """
        state = self.memory.snapshot(-1, self.editor.get_state(), **self._counters())
        state_module.save_snapshot(self.write_dir, state, self.snapshots)

    def close(self) -> StepCache | None:
        """Flush, close and uninstall (end of `fit`); return the step to reuse.

        None where the session had ended already (`abort`): nothing to reuse.
        """
        if not unfinished_fits.finish(self):
            return None
        self.log.close()
        self._say_epoch_reads(False)
        wrapped = self.model.train_function
        self.recorder.uninstall()
        if self.engine.level == "op":
            self.engine.restore()
        # Made after `restore` (which rebuilds the model's functions), so that
        # the next `fit` finds it and reuses the wrapped step.
        self.model.make_train_function(force=True)
        return StepCache(self.model, self.recorder, self.model.train_function, wrapped)

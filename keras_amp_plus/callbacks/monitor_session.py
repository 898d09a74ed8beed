"""One `fit` as seen by `AMPMonitor`: instrumentation, reads, writes, resume.

`MonitorSession.__init__` runs in `on_train_begin` and does every check of
`keras_amp_plus.callbacks.checks` before it touches the model.
"""

import logging

from keras_amp_plus import _compat
from keras_amp_plus.callbacks import checks
from keras_amp_plus.callbacks import state as state_module
from keras_amp_plus.callbacks.attribution import LayerIndex
from keras_amp_plus.callbacks.event_collector import EventCollector
from keras_amp_plus.callbacks.event_log import EventLog
from keras_amp_plus.callbacks.list_editor import ListEditor
from keras_amp_plus.callbacks.step_recorder import (
    SCALER_KAP,
    SCALER_NONE,
    StepRecorder,
)
from keras_amp_plus.policy import PrecisionLists

logger = logging.getLogger("keras_amp_plus")

GUARD_ADVICE = (
    "AMPMonitor: the loss was Inf/NaN on %d step(s) of epoch %d and no loss "
    "scale optimizer skipped them, so the weights were updated with non-finite "
    "gradients. Wrap the optimizer in the guard mode, "
    "`keras_amp_plus.optimizers.LossScaleOptimizer.guard(optimizer)`: it skips "
    "and records every non-finite step (scale fixed at 1, free for bfloat16)."
)


class MonitorSession:
    """State of one `fit` call (see module doc)."""

    def __init__(self, monitor, model):
        self.monitor = monitor
        self.model = model
        self.engine = checks.check_fit_setup(monitor, model)
        optimizer = model.optimizer
        if not _compat.optimizer_built(optimizer):
            # The scaler's variables are read by the wrapped step from its
            # first trace on; `BackupAndRestore` builds it the same way.
            optimizer.build(model.trainable_variables)
        capacity = getattr(optimizer, "event_buffer_size", checks.DEFAULT_CAPACITY)
        self.read_every = monitor.read_every_steps or capacity
        checks.check_read_interval(self.read_every, model.steps_per_execution, capacity)
        self.index = LayerIndex(model)
        self.recorder = StepRecorder(model, capacity)
        self.recorder.install()
        self.collector = EventCollector(
            model, self.recorder, self.index, monitor.replay
        )
        self.editor = ListEditor(self.engine, self.index)
        self.log = EventLog(monitor.log_dir)
        self.started = False
        self.epoch_events = []
        self._written_scalars = None
        self.snapshots = {}

    # -- start / resume ----------------------------------------------------------
    def start(self, epoch: int) -> None:
        """Continue the monitor's record at `epoch` (resume or fresh start)."""
        monitor = self.monitor
        state = monitor.state
        continuing = state.epoch >= 0
        snapshots = state_module.load_snapshots(monitor.log_dir)
        if not continuing:
            snapshot = snapshots.get(epoch - 1)
            if epoch > 0 and snapshot is not None:
                state, continuing = snapshot, True
                logger.info("AMPMonitor: resuming the record of epoch %d.", epoch - 1)
            else:
                state_module.clear_state(monitor.log_dir)
                snapshots = {}
                state.scaler_events = self._scaler_count()
        self.snapshots = {e: s.to_dict() for e, s in snapshots.items()}
        monitor.state = state
        monitor.lists = PrecisionLists.from_config(state.lists)
        monitor.rule.set_state(state.adaptation.get("rule", {}))
        self.editor.set_state(state.adaptation.get("editor", {}))
        self.recorder.restore_counters(state.total_steps, state.recorder_events)
        self.collector.set_cursors(state.recorder_events, state.scaler_events)
        self.log.open(keep_lines=state.jsonl_lines if continuing else None)
        switches_amp_on = getattr(self.engine, "switches_amp_on", False)
        if monitor.lists != PrecisionLists() or switches_amp_on:
            self.engine.apply(self.model, monitor.lists)
        self.log.text("amp/lists", monitor.lists.to_markdown(), epoch)
        self.started = True

    def _scaler_count(self) -> int:
        if self.recorder.kind != SCALER_KAP:
            return 0
        return int(self.model.optimizer.overflow_count.numpy())

    # -- per step / per epoch ----------------------------------------------------
    def begin_epoch(self, epoch: int) -> None:
        """Reset the epoch's counters."""
        self.epoch = epoch
        self.epoch_events = []
        self.last_batch = -1
        self.steps_since_read = 0

    def after_batch(self, batch: int) -> None:
        """Count steps; read the counters every `read_every` steps."""
        self.steps_since_read += batch - self.last_batch
        self.last_batch = batch
        if self.steps_since_read >= self.read_every:
            self.epoch_events.extend(self.drain())

    def steps_in_epoch(self) -> int:
        """Return the number of train steps of the current epoch."""
        return self.last_batch + 1

    def drain(self, force_scalars: bool = False) -> list:
        """Read, attribute and write the events since the last read.

        The step scalars are written when they changed (or when forced, at the
        end of an epoch): most reads find nothing new and cost one host read.
        """
        self.steps_since_read = 0
        events = self.collector.collect(self.epoch)
        state = self.monitor.state
        for event in events:
            self.log.write_record(event)
            logger.debug("AMPMonitor overflow event: %s", event)
        state.skipped_steps += len(events)
        values = (self.loss_scale(), state.skipped_steps)
        if force_scalars or values != self._written_scalars:
            self._written_scalars = values
            self.log.scalars(
                {"amp/loss_scale": values[0], "amp/skipped_steps": values[1]},
                step=int(self.recorder.total_steps.numpy()),
            )
        return events

    def loss_scale(self):
        """Return the current loss scale, or None without a scaler."""
        if self.recorder.kind == SCALER_NONE:
            return None
        return float(_compat.current_loss_scale(self.model.optimizer).numpy())

    def report_epoch(self, epoch, events, steps, per_layer) -> None:
        """Write the per-epoch scalars and log a summary line."""
        # The ITEX engine reads its rewrite log (when one is set) to notice a
        # rewrite that silently did not happen.
        check_rewrites = getattr(self.engine, "check_rewrites", None)
        if check_rewrites is not None:
            check_rewrites()
        state = self.monitor.state
        seen = state.adaptation.setdefault("overflowed_layers", [])
        seen.extend(layer for layer in sorted(per_layer) if layer not in seen)
        values = {
            "amp/overflow_events": len(events),
            "amp/overflow_rate": len(events) / steps if steps else 0.0,
        }
        values.update({f"amp/overflow/{layer}": per_layer[layer] for layer in seen})
        self.log.scalars(values, step=epoch)
        if events:
            logger.info(
                "AMPMonitor epoch %d: %d overflow events in %d steps, loss scale "
                "%s, by layer %s.",
                epoch,
                len(events),
                steps,
                self.loss_scale(),
                dict(per_layer),
            )
        forward = [e for e in events if e["direction"] == "forward"]
        if (
            forward
            and self.recorder.kind == SCALER_NONE
            and not state.guard_recommended
        ):
            logger.warning(GUARD_ADVICE, len(forward), epoch)
            state.guard_recommended = True

    def adapt(self, epoch, evidence) -> list:
        """Apply the adaptation rule; return the list changes made."""
        monitor = self.monitor
        lists = monitor.lists
        denied = self.editor.denied_layers(self.model, lists)
        changes = []
        for decision in monitor.rule.decide(epoch, evidence, denied):
            lists, moved = self.editor.apply(lists, decision)
            for change in moved:
                change.update(reason=decision.reason, evidence=decision.evidence)
                self.log.write_record({"type": "list_change", "epoch": epoch, **change})
                logger.warning(
                    "AMPMonitor epoch %d: %s %r moved from %s to %s (layer %s): %s.",
                    epoch,
                    change["kind"],
                    change["name"],
                    change["from"] or "no list",
                    change["to"] or "no list",
                    change["layer"],
                    decision.reason,
                )
            changes.extend(moved)
        if changes:
            monitor.lists = lists
            self.engine.apply(self.model, lists)
        return changes

    def end_epoch(self, epoch: int) -> None:
        """Snapshot everything a resumed `fit` needs."""
        monitor = self.monitor
        state = monitor.state
        state.epoch = epoch
        state.lists = monitor.lists.get_config()
        state.adaptation.update(
            rule=monitor.rule.get_state(), editor=self.editor.get_state()
        )
        state.total_steps = int(self.recorder.total_steps.numpy())
        state.recorder_events = self.collector.recorder_cursor
        state.scaler_events = self.collector.scaler_cursor
        state.jsonl_lines = self.log.lines_written
        state_module.save_snapshot(monitor.log_dir, state, self.snapshots)
        self.log.flush()

    def close(self) -> None:
        """Flush, close and uninstall (end of `fit`)."""
        self.log.close()
        self.recorder.uninstall()
        if self.engine.level == "op":
            self.engine.restore()

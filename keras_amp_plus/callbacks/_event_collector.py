"""Turn overflow records into attributed overflow events.

One source of events, the most detailed there is:

- our `LossScaleOptimizer`: its `OverflowRecord`s give, per skipped step, the
  scale before and after, NaN or Inf, whether the loss was finite and which
  variables had non-finite gradients (backward attribution);
- otherwise the monitor's `StepRecorder`: with Keras's own scaler it sees the
  scale go down (a skipped step) but not which gradients overflowed; with no
  scaler only steps whose loss is Inf/NaN are events.

In every case a step whose loss is Inf/NaN is a forward overflow and is
attributed by replaying the stashed batch (`attribution.find_forward_overflow`):
the batch of the last such step, so the events of one read share its verdict,
except those whose own batch held Inf/NaN (the recorder notes those steps),
which are bad data, no layer's overflow.
A backward overflow at a trusted scale is replayed too: a forward overflow can
stay hidden from the loss (TensorFlow's Eigen max pooling, used with oneDNN
off, drops NaNs) and show only as non-finite gradients, which would blame the
layers nearest the loss; when the replay finds a layer whose inputs were
finite and whose output was not, that layer is named (a forward overflow).
"""

import dataclasses
import logging

from keras_amp_plus.callbacks import _attribution as attribution
from keras_amp_plus.optimizers import LossScaleOptimizer

logger = logging.getLogger("keras_amp_plus")


# Appended to a forward verdict whose step's loss was seen finite.
LOSS_STAYED_FINITE = " (the loss stayed finite)"


class EventCollector:
    """Read new events every N steps and attribute them to layers.

    Args:
        model: the model being trained.
        recorder: the installed `StepRecorder`.
        index: the model's `LayerIndex`.
        rule: the `AdaptationRule` (which backward overflows are trusted).
        replay: whether forward overflows are replayed to find their layer.
            Defaults to `True`.
    """

    def __init__(self, model, recorder, index, rule, replay: bool = True):
        self.model = model
        self.recorder = recorder
        self.index = index
        self.rule = rule
        self.replay = replay
        self.recorder_cursor = 0
        self.scaler_cursor = 0
        self.scaler_step_shift = 0
        self._replayed = {}
        self._bad_batch_steps = set()

    def set_cursors(
        self, recorder_cursor: int, scaler_cursor: int, scaler_step_shift: int = 0
    ) -> None:
        """Start reading after these counts (a start or a resume).

        Args:
            recorder_cursor: the recorder's events already read.
            scaler_cursor: our scaler's overflow count already read.
            scaler_step_shift: added to our scaler's step numbers (its
                `total_steps`) to number them as the monitor's record does:
                a reloaded, reused or other model's optimizer counts its own
                steps. Defaults to 0.
        """
        self.recorder_cursor = recorder_cursor
        self.scaler_cursor = scaler_cursor
        self.scaler_step_shift = scaler_step_shift

    def collect(self, epoch: int) -> list[dict]:
        """Return the events recorded since the last call, attributed."""
        records = self._read()
        if not records:
            return []
        self.index.set_call_order(self.recorder.call_order)
        self._bad_batch_steps = {
            self._in_record_numbering(step) for step in self.recorder.bad_batch_steps()
        }
        return [self._attribute(record, epoch) for record in records]

    def _in_record_numbering(self, step: int) -> int:
        """Return a step the recorder noted, numbered as the records are."""
        if isinstance(self.model.optimizer, LossScaleOptimizer):
            return step + self.scaler_step_shift  # noted at our scaler's step
        return step

    def _read(self):
        """Return the new `OverflowRecord`s of the one source there is."""
        optimizer = self.model.optimizer
        if isinstance(optimizer, LossScaleOptimizer):
            current = int(optimizer.overflow_count.numpy())
            if current < self.scaler_cursor:
                # The optimizer was reset or replaced (e.g. weights loaded
                # without its variables): read from its current count on,
                # its steps numbered after the record's.
                self.scaler_cursor = current
                self.scaler_step_shift = int(self.recorder.total_steps.numpy()) - int(
                    optimizer.total_steps.numpy()
                )
            records = optimizer.read_records(self.scaler_cursor)
            self.scaler_cursor = current
            return [self._in_record_steps(record) for record in records]
        records, count = self.recorder.read_records(self.recorder_cursor)
        lost = count - self.recorder_cursor - len(records)
        if lost:
            logger.warning(
                "AMPMonitor lost %d overflow events: more events than the ring "
                "buffer holds happened between two reads. Lower "
                "`read_every_steps`.",
                lost,
            )
        self.recorder_cursor = count
        return records

    def _in_record_steps(self, record):
        """Return our scaler's `record` with its step numbered as the record's."""
        return dataclasses.replace(record, step=self._in_record_numbering(record.step))

    def _forward_culprit(self, record_step):
        """Return `(culprit, evidence)` of a possible forward overflow's step.

        `culprit` is `find_forward_overflow`'s result for the batch kept for
        the replay (the last kept step's), or bad data for a step whose own
        batch held Inf/NaN; a step whose verdict would be another step's bad
        data is not replayed (its batch is gone).
        """
        if record_step in self._bad_batch_steps:
            bad = {"layer": None, "reason": attribution.BAD_DATA}
            return bad, f"batch of step {record_step}: {attribution.BAD_DATA}"
        step, batches = self.recorder.stashed_batches()
        if step:
            step = self._in_record_numbering(step)
        if step in self._bad_batch_steps:
            return {"layer": None, "reason": "not_replayed"}, (
                f"not replayed: the batch kept is step {step}'s, which held "
                "Inf/NaN (`read_every_steps=1` replays every step's own)"
            )
        if not batches or not self.replay:
            culprit = {"layer": None, "reason": "no_replay"}
        else:
            culprit = self._replay(step, batches)
        return culprit, f"replay of step {step}: {culprit['reason']}"

    def _replay(self, step, batches):
        """Return the replay's verdict on `step`'s batches (once per step)."""
        if step not in self._replayed:
            try:
                culprit = self._first_overflow(batches)
            except Exception as error:  # the events must be written all the same
                logger.warning(
                    "AMPMonitor could not replay the batch of step %d to find the "
                    "layer that overflowed (%s: %s); its overflow events are "
                    "logged without a layer.",
                    step,
                    type(error).__name__,
                    str(error).splitlines()[0] if str(error) else "",
                )
                culprit = {
                    "layer": None,
                    "reason": f"replay_failed ({type(error).__name__})",
                }
            self._replayed = {step: culprit}
        return self._replayed[step]

    def _first_overflow(self, batches):
        """Return the verdict of the first local replica's share that overflows."""
        for data in batches:
            culprit = attribution.find_forward_overflow(
                self.model, data, self.index.layers, self.index.chain
            )
            if culprit["layer"]:
                break
        return culprit

    def _unwatched_forward(self, record):
        """Return True for a possible forward overflow the loss did not show.

        Only when the loss was not watched (a custom `train_step` computing
        its own) and every gradient was non-finite, or may have been (Keras's
        scaler records none of them); the replay then confirms it or finds
        nothing.
        """
        optimizer = self.model.optimizer
        if record.loss_finite is not None:
            return False
        if not isinstance(optimizer, LossScaleOptimizer):
            return True
        tracked = optimizer.tracked_variable_paths()
        return bool(tracked) and set(record.variables) == set(tracked)

    def _trusted_backward(self, record):
        """Return True for a backward overflow that counts against a layer."""
        return record.loss_finite is not False and self.rule.is_trusted(
            {"direction": "backward", "scale_before": record.scale_before}
        )

    def _attribute(self, record, epoch):
        implicated = self.index.layers_of_variables(record.variables)
        loss_nonfinite = record.loss_finite is False
        kind = "nan" if record.has_nan else "inf"
        if not loss_nonfinite and not isinstance(
            self.model.optimizer, LossScaleOptimizer
        ):
            kind = "unknown"  # Keras's scaler does not say which gradient
        event = {
            "type": "overflow",
            "step": record.step,
            "epoch": epoch,
            "scale_before": record.scale_before,
            "scale_after": record.scale_after,
            "kind": kind,
            "implicated_layers": implicated,
        }
        culprit = None
        if (
            loss_nonfinite
            or self._unwatched_forward(record)
            or self._trusted_backward(record)
        ):
            culprit, evidence = self._forward_culprit(record.step)
        # A step whose own batch held Inf/NaN is bad data whatever its loss.
        bad_data = culprit is not None and culprit["reason"] == attribution.BAD_DATA
        if culprit is not None and (loss_nonfinite or culprit["layer"] or bad_data):
            event["direction"] = "forward"
            event["layers"] = [culprit["layer"]] if culprit["layer"] else []
            event["evidence"] = evidence
            if record.loss_finite:  # not where the step's loss went unseen
                event["evidence"] += LOSS_STAYED_FINITE
        else:
            origin = self.index.backward_origin(implicated)
            event["direction"] = "backward"
            event["layers"] = [origin] if origin else []
            event["evidence"] = (
                "implicated layer closest to the loss"
                if origin
                else "the scaler records no per-variable detail"
            )
        return event

"""Turn the raw in-graph records into attributed overflow events.

Sources, from most to least detail:

- our `LossScaleOptimizer`: its event ring buffer gives, per skipped step, the
  scale before and after, NaN or Inf, and which variables had non-finite
  gradients (backward attribution);
- Keras's own scaler: the monitor's ring sees the scale go down (a skipped
  step) but not which gradients overflowed;
- no scaler: only steps whose loss is Inf/NaN are events.

In every case a step whose loss is Inf/NaN is a forward overflow and is
attributed by replaying the stashed batch (`attribution.find_forward_overflow`).
"""

import logging

from keras_amp_plus.callbacks import _attribution as attribution
from keras_amp_plus.callbacks._step_recorder import SCALER_KAP

logger = logging.getLogger("keras_amp_plus")


class EventCollector:
    """Read new events every N steps and attribute them to layers.

    Args:
        model: the model being trained.
        recorder: the installed `StepRecorder`.
        index: the model's `LayerIndex`.
        replay: whether forward overflows are replayed to find their layer.
            Defaults to `True`.
    """

    def __init__(self, model, recorder, index, replay: bool = True):
        self.model = model
        self.recorder = recorder
        self.index = index
        self.replay = replay
        self.recorder_cursor = 0
        self.scaler_cursor = 0
        self._replayed = {}

    def set_cursors(self, recorder_cursor: int, scaler_cursor: int) -> None:
        """Start reading after these counts (resume)."""
        self.recorder_cursor = recorder_cursor
        self.scaler_cursor = scaler_cursor

    def collect(self, epoch: int) -> list[dict]:
        """Return the events recorded since the last call, attributed."""
        raw, count = self.recorder.read_events(self.recorder_cursor)
        lost = count - self.recorder_cursor - len(raw)
        if lost:
            logger.warning(
                "AMPMonitor lost %d overflow events: more events than the ring "
                "buffer holds happened between two reads. Lower "
                "`read_every_steps`.",
                lost,
            )
        self.recorder_cursor = count
        if not raw:
            return []
        self.index.set_call_order(self.recorder.call_order)
        detail = self._scaler_detail(raw)
        return [
            self._attribute(event, detail.get(event["step"]), epoch) for event in raw
        ]

    def _scaler_detail(self, raw):
        """Return `{step: event}` from our LossScaleOptimizer's own ring buffer."""
        optimizer = self.recorder.optimizer
        if self.recorder.kind != SCALER_KAP:
            return {}
        current = int(optimizer.overflow_count.numpy())
        if current < self.scaler_cursor:
            # The optimizer was reset or replaced (e.g. weights loaded without
            # its variables): read from its current count on.
            self.scaler_cursor = current
        events = optimizer.read_events(self.scaler_cursor)
        self.scaler_cursor = current
        return {event["step"]: event for event in events}

    def _forward_culprit(self):
        step, batches = self.recorder.stashed_batches()
        if not batches or not self.replay:
            return step, {"layer": None, "reason": "no_replay"}
        if step not in self._replayed:
            # Each local replica's share: the first that overflows names it.
            for data in batches:
                culprit = attribution.find_forward_overflow(
                    self.model, data, self.index.layers, self.index.chain
                )
                if culprit["layer"]:
                    break
            self._replayed = {step: culprit}
        return step, self._replayed[step]

    def _unwatched_forward(self, event, detail):
        """Return True for a possible forward overflow the loss did not show.

        Only when the loss was not watched (a custom `train_step`) and every
        gradient was non-finite; the replay then confirms it or finds nothing.
        """
        if self.recorder.loss_watched or detail is None:
            return False
        tracked = self.recorder.optimizer.tracked_variable_paths()
        return bool(tracked) and set(detail["variables"]) == set(tracked)

    def _attribute(self, event, detail, epoch):
        implicated = []
        kind = "nan" if event["loss_has_nan"] else "inf"
        if detail is not None:
            implicated = self.index.layers_of_variables(detail["variables"])
            kind = "nan" if detail["has_nan"] else "inf"
        elif not event["loss_nonfinite"] and self.recorder.kind != SCALER_KAP:
            kind = "unknown"  # Keras's scaler does not say which gradient
        record = {
            "type": "overflow",
            "step": event["step"],
            "epoch": epoch,
            "scale_before": event["scale_before"],
            "scale_after": event["scale_after"],
            "kind": kind,
            "implicated_layers": implicated,
        }
        culprit = None
        if event["loss_nonfinite"] or self._unwatched_forward(event, detail):
            step, culprit = self._forward_culprit()
        if culprit is not None and (event["loss_nonfinite"] or culprit["layer"]):
            record["direction"] = "forward"
            record["layers"] = [culprit["layer"]] if culprit["layer"] else []
            record["evidence"] = f"replay of step {step}: {culprit['reason']}"
        else:
            origin = self.index.backward_origin(implicated)
            record["direction"] = "backward"
            record["layers"] = [origin] if origin else []
            record["evidence"] = (
                "implicated layer closest to the loss"
                if origin
                else "the scaler records no per-variable detail"
            )
        return record

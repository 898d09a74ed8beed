"""`OverflowRecord`: one skipped step, as the loss scaler hands it to the monitor.

The typed interface between the scaler and `AMPMonitor`: the scaler returns
these from `LossScaleOptimizer.read_records`, and the monitor, which recognises
our scaler by its class, takes its events from them. With Keras's own scaler or
no scaler the monitor's in-graph recorder builds the same records from what it
sees itself (the scale going down, an Inf/NaN loss).
"""

import dataclasses

LOSS_FINITE = 0
LOSS_NONFINITE = 1
LOSS_NOT_SEEN = 2


@dataclasses.dataclass(frozen=True)
class OverflowRecord:
    """One overflow event: a step whose loss or gradients were not finite.

    Args:
        index: 1-based number of the event among all events of its source.
        step: 1-based number of the train step it happened in.
        scale_before: loss scale the step was computed with, or None when
            there is no scaler.
        scale_after: loss scale after the step's backoff, or None.
        has_nan: True when a NaN (not only an Inf) was seen.
        variables: paths of the variables whose gradient was not finite,
            in the scaler's build order. Defaults to `()` (unknown).
        loss_finite: whether the (unscaled) loss of the step was finite, or
            None when the source did not see the loss (a custom
            `train_step` that never calls `scale_loss`/`compute_loss`).
            Defaults to `None`.

    Example:
    >>> record = OverflowRecord(1, 7, 1024.0, 512.0, False, ("dense/kernel",))
    >>> record.loss_finite is None, record.variables
    (True, ('dense/kernel',))
    """

    index: int
    step: int
    scale_before: float | None
    scale_after: float | None
    has_nan: bool
    variables: tuple = ()
    loss_finite: bool | None = None

    def as_event(self) -> dict:
        """Return the record as `read_events` gives it (a plain dict)."""
        return {
            "index": self.index,
            "step": self.step,
            "scale_before": self.scale_before,
            "scale_after": self.scale_after,
            "has_nan": self.has_nan,
            "variables": list(self.variables),
        }


def loss_state(code) -> bool | None:
    """Return `loss_finite` from the int code stored in the scaler's ring."""
    code = int(code)
    if code == LOSS_NOT_SEEN:
        return None
    return code == LOSS_FINITE

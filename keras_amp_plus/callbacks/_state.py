"""The monitor's persisted state: `<log_dir>/amp_state.json`.

`keras.callbacks.BackupAndRestore` restores the model weights and optimizer
variables (so our LossScaleOptimizer's counters and event ring) as of the end of
the last completed epoch, and the epoch number; it does not know about the
monitor. The monitor therefore writes, at the end of every epoch, a snapshot of
everything it needs to continue as if never interrupted: the lists, the
adaptation rule's memory, its step and event counters, its read cursors, and the
number of lines of `amp_events.jsonl` written so far. A resumed `fit` starting at
epoch E loads the snapshot of epoch E - 1 and cuts the JSON-lines file back to
that length, so events of the interrupted epoch are not counted twice.
The file goes through TensorFlow's file systems (`tf.io.gfile`), as the
monitor's other logs do. A few recent snapshots are kept because
`BackupAndRestore` may have saved an older epoch than the monitor (the two
write at slightly different moments).
"""

import dataclasses
import json
import os
import weakref

import tensorflow as tf

from keras_amp_plus._lists.precision_lists import PrecisionLists
from keras_amp_plus.callbacks._adaptation import AdaptationRule

STATE_FILE = "amp_state.json"
FORMAT_VERSION = 1
SNAPSHOTS_KEPT = 3


@dataclasses.dataclass
class MonitorState:
    """Everything the monitor carries from one epoch to the next.

    Args:
        epoch: last completed epoch (0-based), -1 before the first. Defaults to
            `-1`.
        lists: the `PrecisionLists` config. Defaults to `{}`.
        adaptation: the adaptation rule's memory. Defaults to `{}`.
        total_steps: train steps seen by the monitor. Defaults to `0`.
        recorder_events: events counted by the monitor's ring. Defaults to `0`.
        scaler_events: overflow count of our LossScaleOptimizer already read.
            Defaults to `0`.
        skipped_steps: cumulative overflow events. Defaults to `0`.
        jsonl_lines: lines of `amp_events.jsonl` at the end of `epoch`.
            Defaults to `0`.
        guard_recommended: whether the bf16 guard advice was logged.
            Defaults to `False`.
        run: number of this run among the runs logged in `log_dir`.
            Defaults to `1`.
        step_offset: TensorBoard step of this run's train step 0 (where the
            previous run stopped). Defaults to `0`.
        epoch_offset: TensorBoard step of epoch 0 of the current `fit`.
            Defaults to `0`.
        run_epoch_offset: TensorBoard step of the run's epoch 0: records
            number epochs from it, across the run's `fit` calls. Defaults
            to `0`.
        last_scale_point: `[TensorBoard step, value]` of the last
            `amp/loss_scale` point written, or None. Defaults to `None`.
        lists_logged: `[TensorBoard step, lists config as JSON]` of the
            last `amp/lists` text written, or None. Defaults to `None`.
    """

    epoch: int = -1
    lists: dict = dataclasses.field(default_factory=dict)
    adaptation: dict = dataclasses.field(default_factory=dict)
    total_steps: int = 0
    recorder_events: int = 0
    scaler_events: int = 0
    skipped_steps: int = 0
    jsonl_lines: int = 0
    guard_recommended: bool = False
    run: int = 1
    step_offset: int = 0
    epoch_offset: int = 0
    run_epoch_offset: int = 0
    last_scale_point: list | None = None
    lists_logged: list | None = None

    def to_dict(self) -> dict:
        """Return the state as JSON-serializable data."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "MonitorState":
        """Rebuild a state from `to_dict()` output, ignoring unknown keys."""
        names = {field.name for field in dataclasses.fields(cls)}
        known = {k: v for k, v in data.items() if k in names}
        # Files of before `run_epoch_offset` numbered epochs per `fit`.
        known.setdefault("run_epoch_offset", known.get("epoch_offset", 0))
        return cls(**known)


class MonitorMemory:
    """The one owner of what the monitor knows: its state, lists and rule.

    `AMPMonitor.lists`, `.state` and `.rule` read from it; the per-`fit`
    session changes them only through it, so the three never disagree (the
    lists in `state.lists` are always `lists`'s config, the rule's memory
    is put in `state.adaptation` at each snapshot).

    Args:
        lists: the initial `PrecisionLists`.
        rule: the monitor's `AdaptationRule`.

    Example:
    >>> memory = MonitorMemory(PrecisionLists(), AdaptationRule())
    >>> memory.set_lists(PrecisionLists(deny_layers=("head",)))
    >>> memory.state.lists["deny_layers"]
    ['head']
    """

    def __init__(self, lists: PrecisionLists, rule: AdaptationRule):
        self.rule = rule
        self.initial_lists = lists
        self.lists = lists
        self.state = MonitorState(lists=lists.get_config())
        self._model = None  # a weak reference to the model last monitored

    def watch(self, model) -> bool:
        """Note that `model` is monitored now; return True if it was last time.

        A monitor's record belongs to the model it watched: another model's
        `fit` (the same callbacks list reused for a second experiment) starts
        a record of its own (`start_over`).
        """
        same = self._model is not None and self._model() is model
        self._model = weakref.ref(model)
        return same

    def start_over(self) -> None:
        """Forget the record: back to the initial lists and a fresh rule."""
        self.lists = self.initial_lists
        self.state = MonitorState(lists=self.initial_lists.get_config())
        self.rule.set_state({})

    def set_lists(self, lists: PrecisionLists) -> None:
        """Make `lists` the current lists."""
        self.lists = lists
        self.state.lists = lists.get_config()

    def set_user_lists(self, lists: PrecisionLists) -> None:
        """Make `lists` the current lists and those a new record starts from."""
        self.initial_lists = lists
        self.set_lists(lists)

    def resume(self, state: MonitorState) -> None:
        """Continue from a saved `state`: its lists and the rule's memory."""
        self.state = state
        self.lists = PrecisionLists.from_config(state.lists)
        self.rule.set_state(state.adaptation.get("rule", {}))

    def snapshot(self, epoch: int, editor_state: dict, **counters) -> MonitorState:
        """Fold the end of `epoch` into the state and return it.

        Args:
            epoch: the epoch that ended.
            editor_state: the list editor's memory (how to undo its moves).
            **counters: `MonitorState` fields to set (cursors, step counts).
        """
        state = self.state
        state.epoch = epoch
        state.lists = self.lists.get_config()
        state.adaptation.update(rule=self.rule.get_state(), editor=editor_state)
        for name, value in counters.items():
            setattr(state, name, value)
        return state


def state_path(log_dir: str) -> str:
    """Return the state file's path inside `log_dir`."""
    return os.path.join(log_dir, STATE_FILE)


def load_snapshots(log_dir: str | None) -> dict[int, MonitorState]:
    """Return `{epoch: state}` from the state file ({} if there is none)."""
    if not log_dir or not tf.io.gfile.exists(state_path(log_dir)):
        return {}
    with tf.io.gfile.GFile(state_path(log_dir)) as f:
        text = f.read()
    try:
        data = json.loads(text)
        written_format = data.get("format")
    except (ValueError, AttributeError) as error:
        raise _unreadable(log_dir, error, text) from error
    if written_format != FORMAT_VERSION:
        raise ValueError(
            f"{state_path(log_dir)} was written by another version of AMPMonitor "
            f"and cannot be resumed. Expected format {FORMAT_VERSION}. Delete the "
            f"file or use another `log_dir`. Received: format={written_format}"
        )
    try:
        states = [MonitorState.from_dict(s) for s in data["snapshots"]]
    except (KeyError, TypeError, AttributeError) as error:
        raise _unreadable(log_dir, error, text) from error
    return {state.epoch: state for state in states}


def _unreadable(log_dir: str, error: Exception, text: str) -> ValueError:
    """Return the error for a state file that is no state AMPMonitor wrote."""
    return ValueError(
        f"{state_path(log_dir)} is not a state file AMPMonitor can read "
        f"({type(error).__name__}: {error}); it holds the snapshots a resumed "
        "`fit` continues from. Expected the JSON object AMPMonitor writes. "
        "Delete the file (the next `fit` starts a new run there) or use "
        f"another `log_dir`. Received: {text[:80]!r}"
    )


def save_snapshot(
    log_dir: str | None, state: MonitorState, snapshots: dict | None = None
) -> None:
    """Add `state` to the state file, keeping the last few epochs.

    Written to a temporary file, then renamed over the old one (atomic on
    local disks; on object stores such as `gs://` a copy, then a delete).

    Args:
        log_dir: the monitor's log directory (None: nothing is written).
        state: the state at the end of `state.epoch`.
        snapshots: `{epoch: state dict}` already in the file, kept up to date
            by this function so the file is not read back every epoch.
            Defaults to `None` (read the file).
    """
    if not log_dir:
        return
    if snapshots is None:
        snapshots = {e: s.to_dict() for e, s in load_snapshots(log_dir).items()}
    for epoch in [e for e in snapshots if e >= state.epoch]:
        del snapshots[epoch]  # a resumed run rewrites abandoned epochs
    snapshots[state.epoch] = state.to_dict()
    for epoch in sorted(snapshots)[:-SNAPSHOTS_KEPT]:
        del snapshots[epoch]
    data = {
        "format": FORMAT_VERSION,
        "snapshots": [snapshots[e] for e in sorted(snapshots)],
    }
    temporary = state_path(log_dir) + ".tmp"
    with tf.io.gfile.GFile(temporary, "w") as f:
        json.dump(data, f, sort_keys=True)
    tf.io.gfile.rename(temporary, state_path(log_dir), overwrite=True)

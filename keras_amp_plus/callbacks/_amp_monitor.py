"""`AMPMonitor`: overflow events to TensorBoard, attributed and acted upon."""

import logging
import os

import keras

from keras_amp_plus._lists.precision_lists import PrecisionLists, as_precision_lists
from keras_amp_plus.callbacks import (
    _checks as checks,
)
from keras_amp_plus.callbacks import (
    _monitor_session as monitor_session,
)
from keras_amp_plus.callbacks._adaptation import AdaptationRule
from keras_amp_plus.callbacks._state import MonitorMemory

logger = logging.getLogger("keras_amp_plus")


class AMPMonitor(keras.callbacks.Callback):
    """Log every overflow, name the layer behind it, and move it to float32.

    Each train step, inside the compiled step, overflow events are recorded in
    graph variables (no host synchronisation; a normal step pays a few scalar
    ops and one conditional); every `read_every_steps` steps (as a batch
    begins: the monitor has no batch-end hook) and at each epoch end the
    monitor reads them exactly, attributes each to a layer, and writes:

    - TensorBoard run `<log_dir>/amp`: `amp/loss_scale` and `amp/skipped_steps`
      (cumulative; without a scaler `amp/nonfinite_steps`, steps whose Inf/NaN
      update was applied) at the global train step; `amp/overflow_events`,
      `amp/overflow_rate` (events / steps), `amp/scale_search_overflows`
      (events at an untrusted scale) and `amp/overflow/<layer path>` per
      epoch (at step = epoch); text `amp/lists` (at step = the epoch the lists
      take effect in: the first, and the one after each change) and
      `amp/changes` (at the epoch that decided them).
    - `<log_dir>/amp_events.jsonl`: one JSON object per overflow event and per
      list change; `<log_dir>/amp_state.json`: what a resumed `fit` needs.
    - `logs["loss_scale"]` (when there is a scaler) and
      `logs["overflow_events"]` each epoch, so History, CSVLogger and Keras's
      TensorBoard record them when the monitor comes before them in the
      callbacks list.
    - Python logging, `logging.getLogger("keras_amp_plus")`.

    Layers are named by their name chain from the model down (`"backbone/hot"`
    for layer `hot` of the nested model `backbone`), which layers without
    weights have too and which `keras.saving.load_model` keeps; lists accept
    it, the layer's name and its Keras `path`.

    An overflow counts against a layer (is *attributed*) when it is forward
    or happened at a trusted scale (`trusted_backward_scale`); backward
    overflows above it are the scaler's search for its scale and are logged
    as such. When layers are denied for forward overflows the loss scale is
    put back to where it was before them (a layer denied in vain is said
    once, as `"denial_without_effect"`). Every run in one `log_dir` is appended to
    `amp_events.jsonl` with its run number (`"run"`), and its TensorBoard
    steps continue after the previous run's. One monitor's further `fit`s of
    the same model continue its run, its epochs and steps; a `fit` of another
    model (a callbacks
    list reused for the next experiment) starts a new run from the lists the
    monitor was given, not the ones it adapted for the model before.

    With our `LossScaleOptimizer` the events are the scaler's own records
    (`read_records`); the monitor's in-graph recorder only keeps the batch of
    an overflow step for the replay. Backward overflows are attributed from
    the scaler's per-variable records to the implicated layer closest to the
    loss; forward overflows (Inf/NaN loss) by replaying the step's batch to
    find the innermost layer whose inputs were finite and output was not (one
    batch is kept, the last overflow step's: the events of one read share its
    verdict, except steps whose own batch held Inf/NaN, logged as bad data). A
    backward overflow at a trusted scale is replayed too, and named as a
    forward overflow when the replay finds such a layer: a forward overflow
    can stay hidden from the loss (TensorFlow's Eigen max pooling, used with
    oneDNN off, drops NaNs). With Keras's own scaler events come from scale
    changes (forward ones still attributed); with no scaler (bfloat16) the
    monitor watches for Inf/NaN losses and recommends
    `LossScaleOptimizer.guard`. With `adapt=True`, at each epoch end, a layer
    whose accumulated evidence reaches `deny_threshold` moves to the deny
    list at once, and a denied layer moves back after `patience` clean
    epochs (see the arguments), through the engine, at the first step of the
    next epoch that runs one: of the same `fit`, or, after its last epoch (or
    once a callback stopped it), of the model's next `fit` (with `adapt` on).
    A checkpoint saved at an epoch end holds the lists of the state file, and
    the model `fit` returns no layer in a precision it overflowed in, untried.
    NaN results of `fit`'s
    validation, which runs before the monitor denies a layer, read as their
    worst values, as a skipped epoch's metrics do (`exclude_skipped_steps`),
    with a warning.

    During `fit` only, the model's `train_step`, `compute_loss`,
    `make_train_function` and `get_metrics_result` are wrapped on the instance
    (restored in `on_train_end`; after a `fit` that stopped on an exception,
    when it stops, or at the next sign that it did: the model's next `fit`,
    or any monitored `fit` in the thread). One monitor per model at a time.
    At each epoch end the monitor
    snapshots its state to `amp_state.json`, so a `fit` resumed by
    `keras.callbacks.BackupAndRestore` (`save_freq="epoch"`) continues with the
    same lists, counters and event file: the lines of the interrupted epoch are
    dropped and that epoch's events are counted again, once. With the `keras`
    engine the lists also live in the layers' dtype policies, which
    `model.save` keeps.

    The model must be built before `fit` (as for Keras's `BackupAndRestore`):
    the optimizer (and the scaler's state) is built for the model's variables
    before the first step. Build a subclassed model, or a `Sequential` without
    an `Input`, by calling it on a batch (`model(x[:1])`); an unbuilt one
    raises in `on_train_begin`, before any step runs.

    Args:
        log_dir: directory for TensorBoard, the JSON-lines file and the state
            file, or None for Python logging only. Defaults to `None`.
        lists: initial `PrecisionLists` (or its config dict); `monitor.lists`
            is always the current lists. Defaults to `None` (empty lists).
        engine: "auto", "keras", "grappler", "itex" or an Engine. "auto"
            never turns on a precision you did not ask for: the layer engine
            `keras`, or a graph engine when `lists` holds op types (or, for a
            float32 model, when a graph rewrite is already on). A
            graph engine that cannot work here (grappler with oneDNN off)
            raises in `on_train_begin`. A name is resolved at every `fit`
            (a reused monitor may meet another model or other lists); from
            `on_train_begin` on, `monitor.engine` is the Engine really used
            (pass it to `precision_report`). Defaults to `"auto"`.
        adapt: whether to move layers between lists. Defaults to `True`.
        deny_threshold: accumulated evidence (events attributed to one layer
            at a trusted scale, decayed by `evidence_decay` per epoch) that
            denies it. Defaults to `2`.
        patience: clean epochs before a denied layer is tried in low precision
            again (doubled at each new denial). Defaults to `5`.
        cooldown: epochs after a layer moves back before another may.
            Defaults to `1`.
        max_retries: times a layer may move back before it stays denied.
            Defaults to `2`.
        trusted_backward_scale: backward overflows count as evidence against a
            layer only at a loss scale at or below this (above it the scaler is
            still searching). Defaults to `1.0`.
        read_every_steps: steps between two reads of the counters; at most the
            event ring's capacity (our scaler's `event_buffer_size`, else 64).
            Defaults to `None` (the capacity).
        replay: replay forward overflows to find their layer. Defaults to `True`.
        evidence_decay: factor in [0, 1) by which a layer's evidence shrinks at
            each epoch end, so sporadic overflows add up: one event in each of
            3 epochs denies a layer at the defaults, one event in a long run
            does not. 0 counts each epoch alone. Defaults to `0.7`.
        exclude_skipped_steps: leave the loss (and metrics) of steps the scaler
            skipped out of the epoch's averages, so `EarlyStopping` and
            `ReduceLROnPlateau` see the loss of the applied steps. When every
            step of the epoch was skipped, every callback, wherever it is
            listed, reads each metric's worst value (`inf` for the loss,
            `-inf` for accuracy, NaN where Keras knows no direction), which
            any later measured epoch beats (Keras would report 0, a best
            loss). Before the epoch's first applied step a batch's logs are
            the step's own where finite (a step skipped for a backward
            overflow has a real loss), else Keras's empty 0: a non-finite
            batch loss would make `TerminateOnNaN` stop the run at a skipped
            step, before the monitor can deny the layer. Defaults to `True`.

    Example:
    >>> import keras, numpy as np
    >>> from keras_amp_plus.callbacks import AMPMonitor
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    >>> model.compile("sgd", "mse")
    >>> monitor = AMPMonitor(adapt=False)
    >>> history = model.fit(np.ones((8, 4)), np.ones((8, 1)), verbose=0,
    ...                     callbacks=[monitor])
    >>> history.history["overflow_events"]
    [0]
    """

    def __init__(
        self,
        log_dir: str | None = None,
        lists: PrecisionLists | dict | None = None,
        engine="auto",
        adapt: bool = True,
        deny_threshold: int = 2,
        patience: int = 5,
        cooldown: int = 1,
        max_retries: int = 2,
        trusted_backward_scale: float = 1.0,
        read_every_steps: int | None = None,
        replay: bool = True,
        evidence_decay: float = 0.7,
        exclude_skipped_steps: bool = True,
    ):
        super().__init__()
        checks.check_arguments(
            log_dir=log_dir,
            read_every_steps=read_every_steps,
            engine=engine,
            trusted_backward_scale=trusted_backward_scale,
            evidence_decay=evidence_decay,
            flags={
                "adapt": adapt,
                "replay": replay,
                "exclude_skipped_steps": exclude_skipped_steps,
            },
            counts={
                "deny_threshold": deny_threshold,
                "patience": patience,
                "cooldown": cooldown,
                "max_retries": max_retries,
            },
        )
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        if isinstance(self.log_dir, bytes):
            self.log_dir = os.fsdecode(self.log_dir)
        # What the user asked for, resolved at every `fit`; `self.engine` is
        # the Engine really used from the first `on_train_begin` on.
        self.requested_engine = engine
        self.engine = engine
        self.adapt = bool(adapt)  # NumPy bools too
        self.trusted_backward_scale = float(trusted_backward_scale)
        self.read_every_steps = read_every_steps
        self.replay = bool(replay)
        self.exclude_skipped_steps = bool(exclude_skipped_steps)
        rule = AdaptationRule(
            deny_threshold,
            patience,
            cooldown,
            max_retries,
            evidence_decay=float(evidence_decay),
            trusted_backward_scale=self.trusted_backward_scale,
        )
        # The one owner of the state, the lists and the rule's memory.
        self._memory = MonitorMemory(as_precision_lists(lists), rule)
        self._session = None
        self._step_cache = None

    @property
    def lists(self) -> PrecisionLists:
        """The current lists (the initial ones until a change or a resume)."""
        return self._memory.lists

    @lists.setter
    def lists(self, lists) -> None:
        self._memory.set_user_lists(as_precision_lists(lists))

    @property
    def state(self):
        """The `MonitorState` a resumed `fit` continues from."""
        return self._memory.state

    @property
    def rule(self) -> AdaptationRule:
        """The `AdaptationRule` that moves layers between lists."""
        return self._memory.rule

    # -- fit hooks ---------------------------------------------------------------
    def on_train_begin(self, logs=None):
        """Check everything that could fail, then instrument the model."""
        self._session = monitor_session.MonitorSession(
            self, self.model, self._memory, self._step_cache
        )
        # Public from here on: the engine really used, for precision_report.
        self.engine = self._session.engine

    def on_epoch_begin(self, epoch, logs=None):
        """Resume or start the record (first epoch), reset epoch counters."""
        self._session.begin_epoch(epoch)

    def on_train_batch_begin(self, batch, logs=None):
        """Read the records every `read_every_steps` steps.

        At the beginning of a batch, not its end: a batch-end hook makes
        Keras convert every step's logs on the host before the next step
        starts (it dispatches batch-end hooks to a thread only when no
        callback has one), which costs more than the whole monitor.
        """
        self._session.before_batch(batch)

    def on_test_begin(self, logs=None):
        """Note that `fit` validates: NaN results read as their worst values."""
        if self._session is not None:
            self._session.begin_validation()

    def on_test_end(self, logs=None):
        """Note that `fit`'s validation ended."""
        if self._session is not None:
            self._session.end_validation()

    def on_epoch_end(self, epoch, logs=None):
        """Report the epoch, adapt the lists, save the state."""
        self._session.end_epoch(epoch, logs)

    def on_train_end(self, logs=None):
        """Flush the logs and give the model its own train step back."""
        if self._session is not None:
            self._step_cache = self._session.close()

    # -- serialization -----------------------------------------------------------
    def get_config(self) -> dict:
        """Return the constructor arguments, with the current lists."""
        return {
            "log_dir": self.log_dir,
            "lists": self.lists.get_config(),
            "engine": getattr(self.requested_engine, "name", self.requested_engine),
            "adapt": self.adapt,
            "deny_threshold": self.rule.deny_threshold,
            "patience": self.rule.patience,
            "cooldown": self.rule.cooldown,
            "max_retries": self.rule.max_retries,
            "trusted_backward_scale": self.trusted_backward_scale,
            "read_every_steps": self.read_every_steps,
            "replay": self.replay,
            "evidence_decay": self.rule.evidence_decay,
            "exclude_skipped_steps": self.exclude_skipped_steps,
        }

    @classmethod
    def from_config(cls, config: dict) -> "AMPMonitor":
        """Create a monitor from `get_config()` output."""
        return cls(**config)

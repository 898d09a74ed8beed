"""A loss scaler that records every overflow, has a floor and a ceiling."""

import keras

from keras_amp_plus import _compat
from keras_amp_plus.optimizers import (
    _apply_step,
    _arguments,
    _compiled_update,
    _overflow_records,
    _scale_schedule,
)
from keras_amp_plus.optimizers._overflow_record import OverflowRecord


@keras.saving.register_keras_serializable(package="keras_amp_plus")
class LossScaleOptimizer(_compat.LossScaleOptimizerBase):
    """Dynamic loss scaling that records every skipped step and its cause.

    A subclass of `keras.optimizers.LossScaleOptimizer`, so `model.compile`
    under `mixed_float16` uses it as is. With the new arguments at their
    defaults it behaves like Keras's scaler, except that the scale stays in
    `[min_scale, max_scale]`. Each step, inside the compiled train step:

    ```
    if every gradient is finite:
        apply(gradients / scale); good_steps += 1
        if good_steps == dynamic_growth_steps:
            scale = min(scale * growth_factor, max_scale)
            good_steps = 0; overflows = 0
    else:                                   # the step is skipped
        record the event; good_steps = 0; overflows += 1
        if scale <= min_scale: on_min_scale ("raise" | "warn" | "ignore")
        if overflows == hysteresis:
            scale = max(scale * backoff_factor, min_scale); overflows = 0
    ```

    In a graph step without a distribution strategy, the inner optimizer's
    update runs as one XLA computation (one fused loop per variable rather
    than a kernel per element-wise op) once the variables are large enough to
    pay for it; the values equal the inner optimizer's to float32 rounding.

    A skipped step leaves the weights and the inner optimizer's slots and
    `iterations` untouched (on Keras 2 it adds one to `iterations`, as Keras
    2's scaler does). Unlike DeepSpeed/Megatron, whose hysteresis stays
    spent after the first backoff, the overflow count restarts after every
    backoff, so each backoff takes `hysteresis` overflows.

    Records, all optimizer variables (saved with checkpoints and `.keras`
    files): `overflow_count`, `nan_steps`, `inf_steps` (Inf but no NaN),
    `last_step_skipped`, `total_steps` (every `apply()`),
    `min_scale_overflow_count` and `last_min_scale_overflow_step` (overflows
    with the scale at its floor), per-variable `variable_overflow_counts`, the
    hysteresis state `overflows_since_scale_change`, and a ring buffer of the last
    `event_buffer_size` events (`event_steps`, `event_scales_before`,
    `event_scales_after`, `event_has_nan`, `event_variable_masks`, and
    `event_loss_states`: whether the loss `scale_loss` saw was finite). Read
    them with `overflow_summary()`, `read_events()` or, typed,
    `read_records()`.

    For bfloat16, which has float32's exponent range, use the guard mode
    `LossScaleOptimizer.guard(inner_optimizer)`: the scale is fixed at 1 and
    never grows, every non-finite step is skipped and recorded.

    Args:
        inner_optimizer: the `keras.optimizers.Optimizer` to wrap.
        initial_scale: float in `[min_scale, max_scale]`. Defaults to `2**15`.
        dynamic_growth_steps: int >= 1, finite steps between growths.
            Defaults to `2000`.
        growth_factor: float >= 1, applied on growth. Defaults to `2.0`.
        backoff_factor: float in (0, 1), applied on backoff. Defaults to `0.5`.
        min_scale: positive float, the floor. Defaults to `1.0`.
        max_scale: float >= min_scale, the ceiling. Defaults to `2**24`.
        hysteresis: int >= 1, overflows since the last scale change needed
            to back off (every overflow step is skipped). Defaults to `1`.
        on_min_scale: what an overflow at the floor does: `"raise"` stops
            training with `tf.errors.InvalidArgumentError` naming the scale, the
            step and what to try; `"warn"` warns once and goes on; `"ignore"`.
            Under `jit_compile=True` (XLA cannot call back to Python) the
            action runs at the next `overflow_summary()`, `read_events()` or
            `check_min_scale()` call, raising `RuntimeError` for `"raise"`;
            a warning says so when the step is traced, except for `"warn"`
            while `AMPMonitor` runs (it makes that call every epoch).
            Defaults to `"warn"`.
        event_buffer_size: int from 1 to 65536, capacity of the event ring buffer.
            Defaults to `64`.
        name: optional name. Defaults to `None`.

    Example:
    >>> import keras, keras_amp_plus, tensorflow as tf
    >>> opt = keras_amp_plus.optimizers.LossScaleOptimizer(
    ...     keras.optimizers.SGD(0.1), initial_scale=8.0, min_scale=2.0)
    >>> v = keras.Variable([1.0])
    >>> with tf.GradientTape() as tape:  # a loss that overflowed
    ...     scaled = opt.scale_loss(keras.ops.sum(v * float("inf")))
    >>> opt.apply(tape.gradient(scaled, [v]), [v])
    >>> opt.overflow_summary()["overflow_count"], float(v.numpy()[0])
    (1, 1.0)
    >>> opt.overflow_summary()["loss_scale"]
    4.0

    Reference:
        Micikevicius et al., "Mixed Precision Training", ICLR 2018.
    """

    def __init__(
        self,
        inner_optimizer: keras.optimizers.Optimizer,
        initial_scale: float = 2.0**15,
        dynamic_growth_steps: int = 2000,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
        hysteresis: int = 1,
        on_min_scale: str = "warn",
        event_buffer_size: int = 64,
        name: str | None = None,
        **kwargs,
    ):
        _arguments.check_inner_optimizer(inner_optimizer)
        _arguments.check_scale_bounds(initial_scale, min_scale, max_scale)
        _arguments.check_schedule(
            growth_factor, backoff_factor, dynamic_growth_steps, hysteresis
        )
        _arguments.check_on_min_scale(on_min_scale)
        _arguments.check_event_buffer_size(event_buffer_size)
        super().__init__(
            inner_optimizer,
            initial_scale=float(initial_scale),
            dynamic_growth_steps=int(dynamic_growth_steps),
            name=name,
            **kwargs,
        )
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self.hysteresis = int(hysteresis)
        self.on_min_scale = on_min_scale
        self.event_buffer_size = int(event_buffer_size)
        self._warned_at_min_scale = False
        # Set when an XLA-compiled step traced the floor check (see
        # `check_min_scale`): the action then runs on the host.
        self._min_scale_action_on_host = False
        self._min_scale_overflows_seen = 0
        # Whether the wait was said, and whether a callback reads the records
        # every epoch (`_scale_schedule.read_each_epoch`), which makes it moot
        # for "warn".
        self._deferral_said = False
        self._read_each_epoch = False
        self._loss_watch = _overflow_records.LossWatch()
        self._compiled_updates = _compiled_update.CompiledUpdates()

    @classmethod
    def guard(
        cls,
        inner_optimizer: keras.optimizers.Optimizer,
        event_buffer_size: int = 64,
        name: str | None = None,
    ) -> "LossScaleOptimizer":
        """Return a pure guard for bfloat16: scale fixed at 1, no growth.

        Every non-finite step is skipped and recorded; nothing else changes
        (the loss is not multiplied, the gradients are not divided). It is
        `LossScaleOptimizer(inner, initial_scale=1, min_scale=1, max_scale=1,
        on_min_scale="ignore")`, and round-trips through `get_config` as such.

        Args:
            inner_optimizer: the `keras.optimizers.Optimizer` to wrap.
            event_buffer_size: capacity of the event ring buffer. Defaults
                to `64`.
            name: optional name. Defaults to `None`.

        Returns:
            A `LossScaleOptimizer` with the scale fixed at 1.

        Example:
        >>> import keras, keras_amp_plus
        >>> guard = keras_amp_plus.optimizers.LossScaleOptimizer.guard(
        ...     keras.optimizers.SGD(0.5))
        >>> v = keras.Variable([1.0])
        >>> guard.apply([keras.ops.array([float("nan")])], [v])
        >>> guard.apply([keras.ops.array([1.0])], [v])
        >>> float(v.numpy()[0]), guard.overflow_summary()["nan_steps"]
        (0.5, 1)
        """
        return cls(
            inner_optimizer,
            initial_scale=1.0,
            min_scale=1.0,
            max_scale=1.0,
            on_min_scale="ignore",
            event_buffer_size=event_buffer_size,
            name=name,
        )

    def build(self, var_list: list) -> None:
        """Create Keras's scaler state, the inner slots and the overflow records."""
        super().build(var_list)
        self._tracked = _overflow_records.TrackedVariables(var_list)
        _overflow_records.build_overflow_records(self, var_list)

    def load_own_variables(self, store) -> None:
        """Load the saved variables; floor overflows loaded were acted on before.

        A file saved with Keras's own `LossScaleOptimizer` holds its scale,
        step counter and inner optimizer's variables but no records: those are
        loaded and the records start empty. A file of an earlier layout of this
        scaler loads every record it holds.
        """
        if not (self.built and _overflow_records.load_earlier_layout(self, store)):
            super().load_own_variables(store)
        if self.built:
            # Without this, the host-side `on_min_scale` action of an
            # XLA-compiled step raised or warned again for loaded counts.
            self._min_scale_overflows_seen = int(self.min_scale_overflow_count.numpy())

    def apply(self, grads: list, trainable_variables: list | None = None) -> None:
        """Apply the unscaled gradients, or skip the step and record why."""
        if not self.built:
            with _compat.optimizer_build_scope(self):
                self.build(trainable_variables)
            self.built = True
        _apply_step.apply_step(self, grads, trainable_variables)

    def scale_loss(self, loss):
        """Multiply the loss by the current scale (a no-op in guard mode).

        The loss's finiteness is noted for this step's `apply`, which records
        it with an overflow event (an Inf/NaN loss is a forward overflow).
        """
        self._loss_watch.watch(loss)
        if _apply_step.in_guard_mode(self):
            return loss
        return super().scale_loss(loss)

    def overflow_summary(self) -> dict:
        """Return the overflow counts, the current scale and the per-variable counts.

        Returns:
            A plain dict: `{"overflow_count": int, "nan_steps": int,
            "inf_steps": int, "last_step_skipped": bool, "loss_scale": float,
            "by_variable": {variable.path: int}}`.
        """
        self.check_min_scale()
        return _overflow_records.overflow_summary(self)

    def check_min_scale(self) -> None:
        """Apply `on_min_scale` on the host for an XLA-compiled train step.

        Without XLA the action runs inside the step and this does nothing.
        Under `jit_compile=True` it raises `RuntimeError` ("raise") or warns
        once ("warn") if overflows hit the floor since the last check.
        """
        _scale_schedule.check_min_scale_on_host(self)

    def tracked_variable_paths(self) -> list[str]:
        """Return variable paths in the order of the per-variable records.

        Each path once: one that repeats between variables gets its rank
        after it (`"gamma#2"`).
        """
        return _overflow_records.tracked_variable_paths(self)

    def tracked_variables(self) -> list:
        """Return the variables of the per-variable records, in their order."""
        return _overflow_records.tracked_variables(self)

    def read_events(self, since_count: int = 0) -> list[dict]:
        """Return the overflow events with index greater than `since_count`.

        Each event is a dict with `index`, `step`, `scale_before`,
        `scale_after`, `has_nan` and `variables` (paths). Warns when events
        were overwritten before being read.

        Args:
            since_count: the `overflow_count` last seen, an int >= 0.
                Defaults to `0` (every event still held).
        """
        return [record.as_event() for record in self.read_records(since_count)]

    def read_records(self, since_count: int = 0) -> list[OverflowRecord]:
        """Return the overflow events after `since_count` as `OverflowRecord`s.

        The same events as `read_events`, typed, with one more fact: whether
        the step's loss was finite (`loss_finite`, None when `scale_loss`
        did not see it). This is what `AMPMonitor` reads.

        Args:
            since_count: the `overflow_count` last seen, an int >= 0.
                Defaults to `0` (every event still held).
        """
        self.check_min_scale()
        return _overflow_records.read_records(self, since_count)

    def get_config(self) -> dict:
        """Return Keras's config plus every argument this subclass adds."""
        config = super().get_config()
        config.update(
            {
                "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor,
                "min_scale": self.min_scale,
                "max_scale": self.max_scale,
                "hysteresis": self.hysteresis,
                "on_min_scale": self.on_min_scale,
                "event_buffer_size": self.event_buffer_size,
            }
        )
        return config

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Create the scaler from `get_config()` output (the dict is not consumed)."""
        return super().from_config(dict(config), custom_objects=custom_objects)

"""The loss-scale state machine, stepped one `apply()` at a time."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_amp_plus.optimizers import LossScaleOptimizer, _scale_schedule

INF = float("inf")


def make_stepper(optimizer, variable, compiled):
    """Return step(grad_value) running one apply, eagerly or in a tf.function."""
    optimizer.build([variable])

    def step(gradient):
        optimizer.apply([gradient], [variable])

    run = tf.function(step) if compiled else step

    def call(value):
        run(tf.constant([value], tf.float32))

    return call


def scale_of(optimizer):
    return float(optimizer.dynamic_scale.numpy())


@pytest.mark.parametrize("compiled", [False, True])
def test_four_overflows_back_off_400_to_25_and_skip_every_step(compiled):
    variable = keras.Variable([1.0])
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=400.0, on_min_scale="ignore"
    )
    step = make_stepper(optimizer, variable, compiled)
    expected = [200.0, 100.0, 50.0, 25.0]
    for number, scale in enumerate(expected, start=1):
        step(INF)
        assert scale_of(optimizer) == scale
        assert int(optimizer.overflow_count.numpy()) == number
    assert variable.numpy().tolist() == [1.0]
    assert int(optimizer.iterations.numpy()) == 0
    assert int(optimizer.total_steps.numpy()) == 4


@pytest.mark.parametrize("compiled", [False, True])
def test_growth_after_dynamic_growth_steps_finite_steps(compiled):
    variable = keras.Variable([1.0])
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.5), initial_scale=8.0, dynamic_growth_steps=3
    )
    step = make_stepper(optimizer, variable, compiled)
    expected_weight = 1.0
    for number, expected_scale in enumerate([8.0, 8.0, 16.0, 16.0, 16.0, 32.0], 1):
        scale_before = scale_of(optimizer)
        step(4.0)  # a scaled gradient: the true gradient is 4 / scale
        expected_weight -= 0.5 * 4.0 / scale_before
        assert scale_of(optimizer) == expected_scale, number
        np.testing.assert_allclose(variable.numpy(), [expected_weight], rtol=1e-6)
    assert int(optimizer.iterations.numpy()) == 6
    assert int(optimizer.overflow_count.numpy()) == 0


def test_scale_never_falls_below_min_scale():
    variable = keras.Variable([1.0])
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        initial_scale=12.0,
        min_scale=4.0,
        on_min_scale="ignore",
    )
    step = make_stepper(optimizer, variable, compiled=True)
    scales = []
    for _ in range(4):
        step(INF)
        scales.append(scale_of(optimizer))
    assert scales == [6.0, 4.0, 4.0, 4.0]
    assert int(optimizer.overflow_count.numpy()) == 4


def test_scale_never_rises_above_max_scale():
    variable = keras.Variable([1.0])
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        initial_scale=8.0,
        max_scale=24.0,
        dynamic_growth_steps=1,
    )
    step = make_stepper(optimizer, variable, compiled=True)
    scales = []
    for _ in range(4):
        step(1.0)
        scales.append(scale_of(optimizer))
    assert scales == [16.0, 24.0, 24.0, 24.0]


@pytest.mark.parametrize("compiled", [False, True])
def test_hysteresis_backs_off_on_every_nth_overflow_since_last_change(compiled):
    variable = keras.Variable([1.0])
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        initial_scale=64.0,
        hysteresis=3,
        dynamic_growth_steps=2,
        on_min_scale="ignore",
    )
    step = make_stepper(optimizer, variable, compiled)
    trace = []
    # 3 overflows -> one backoff; 2 overflows, 2 finite (growth resets the
    # overflow count), 2 overflows -> no backoff; third one -> backoff.
    for value in [INF, INF, INF, INF, INF, 1.0, 1.0, INF, INF, INF]:
        step(value)
        trace.append(scale_of(optimizer))
    assert trace == [64, 64, 32, 32, 32, 32, 64, 64, 64, 32]
    assert int(optimizer.overflow_count.numpy()) == 8  # every overflow skipped
    assert int(optimizer.iterations.numpy()) == 2


def reference_schedule(steps, initial, growth_steps, growth, backoff, low, high, hyst):
    """Plain-Python float64 model of the documented pseudo-code."""
    scale, good, overflows, trace = float(initial), 0, 0, []
    for finite in steps:
        if finite:
            good += 1
            if good == growth_steps:
                scale, good, overflows = min(scale * growth, high), 0, 0
        else:
            good, overflows = 0, overflows + 1
            if overflows == hyst:
                scale, overflows = max(scale * backoff, low), 0
        trace.append(scale)
    return trace


@pytest.mark.parametrize("hysteresis", [1, 2])
def test_random_sequence_matches_reference_schedule(hysteresis):
    rng = np.random.default_rng(hysteresis)
    steps = (rng.random(60) > 0.35).tolist()
    args = dict(
        initial_scale=32.0,
        dynamic_growth_steps=3,
        growth_factor=4.0,
        backoff_factor=0.25,
        min_scale=2.0,
        max_scale=512.0,
        hysteresis=hysteresis,
    )
    variable = keras.Variable([1.0])
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.0), on_min_scale="ignore", **args
    )
    step = make_stepper(optimizer, variable, compiled=True)
    trace = []
    for finite in steps:
        step(1.0 if finite else INF)
        trace.append(scale_of(optimizer))
    expected = reference_schedule(steps, *args.values())
    assert trace == expected
    assert int(optimizer.overflow_count.numpy()) == steps.count(False)


@pytest.mark.parametrize("compiled", [False, True])
def test_defaults_behave_like_keras_scaler(compiled):
    # Compared after every step: scale, growth counter, iterations (which a
    # skipped step does not advance), weight and the inner optimizer's slots.
    grads = [3.0, INF, 5.0, 2.0, float("nan"), 1.0, 7.0, 0.5, 1.0, 1.0, INF, 2.0]
    results = []
    for cls in (keras.optimizers.LossScaleOptimizer, LossScaleOptimizer):
        variable = keras.Variable([1.0])
        optimizer = cls(keras.optimizers.Adam(0.1), dynamic_growth_steps=2)
        step = make_stepper(optimizer, variable, compiled)
        trace = []
        for value in grads:
            step(value)
            slots = [v.numpy().tolist() for v in optimizer.inner_optimizer.variables]
            trace.append(
                (
                    scale_of(optimizer),
                    int(optimizer.step_counter.numpy()),
                    int(optimizer.iterations.numpy()),
                    float(variable.numpy()[0]),
                    slots,
                )
            )
        results.append(trace)
    keras_trace, our_trace = results
    # The state machine exactly; weights and slots to float32 rounding (in a
    # compiled step ours updates them in one XLA computation).
    assert [t[:3] for t in our_trace] == [t[:3] for t in keras_trace]
    for ours, theirs in zip(our_trace, keras_trace, strict=True):
        assert ours[3] == pytest.approx(theirs[3], rel=1e-6)
        for our_slot, their_slot in zip(ours[4], theirs[4], strict=True):
            np.testing.assert_allclose(our_slot, their_slot, rtol=1e-6)
    assert [t[0] for t in results[1]][:4] == [2.0**15, 2.0**14, 2.0**14, 2.0**15]
    assert results[1][-1][2] == len(grads) - 3  # three skipped steps


def overflowing_model(optimizer):
    """A model whose every step overflows: its input holds an Inf."""
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer, "mse")
    x = np.array([[INF, 1.0]] * 4, "float32")
    y = np.ones((4, 1), "float32")
    return model, x, y


def test_on_min_scale_raise_stops_fit_with_clear_message():
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        initial_scale=4.0,
        min_scale=2.0,
        on_min_scale="raise",
    )
    model, x, y = overflowing_model(optimizer)
    with pytest.raises(tf.errors.InvalidArgumentError) as info:
        model.fit(x, y, batch_size=2, epochs=3, verbose=0)
    message = str(info.value)
    assert "at step 2" in message
    assert "loss scale 2" in message and "min_scale=2" in message
    assert "learning rate" in message  # says what to try
    assert scale_of(optimizer) == 2.0


def test_on_min_scale_warn_warns_once_and_goes_on():
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=2.0, min_scale=2.0
    )
    model, x, y = overflowing_model(optimizer)
    with pytest.warns(UserWarning, match="already at its floor") as caught:
        model.fit(x, y, batch_size=2, epochs=3, verbose=0)
    floor_warnings = [w for w in caught if "floor" in str(w.message)]
    assert len(floor_warnings) == 1
    assert "at step 1" in str(floor_warnings[0].message)
    assert int(optimizer.overflow_count.numpy()) == 6


def test_on_min_scale_ignore_is_silent():
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        initial_scale=2.0,
        min_scale=2.0,
        on_min_scale="ignore",
    )
    model, x, y = overflowing_model(optimizer)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.fit(x, y, batch_size=2, epochs=2, verbose=0)
    assert int(optimizer.overflow_count.numpy()) == 4
    assert scale_of(optimizer) == 2.0


def test_under_xla_the_floor_action_runs_at_the_next_host_read():
    # XLA cannot compile py_function/Assert, so a jit_compile=True step must
    # compile with the default on_min_scale="warn" and act at the host read.
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        initial_scale=4.0,
        min_scale=2.0,
        on_min_scale="raise",
    )
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer, "mse", jit_compile=True)
    x = np.array([[INF, 1.0]] * 4, "float32")
    with pytest.warns(UserWarning, match="cannot act inside an XLA-compiled"):
        model.fit(x, np.ones((4, 1), "float32"), batch_size=2, verbose=0)
    assert int(optimizer.min_scale_overflow_count.numpy()) == 1
    with pytest.raises(RuntimeError, match="at step 2 while the loss scale"):
        optimizer.overflow_summary()
    optimizer.check_min_scale()  # already reported: silent until the next hit


def test_under_xla_with_amp_monitor_the_default_warn_says_only_the_floor(tmp_path):
    # AMPMonitor reads the scaler every epoch: the default "warn" needs no
    # warning that it waits for the host, and the floor's own warning comes
    # at the epoch's end. A later fit without the monitor is told again.
    from keras_amp_plus.callbacks import AMPMonitor

    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=4.0, min_scale=2.0
    )
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer, "mse", jit_compile=True)
    x = np.array([[INF, 1.0]] * 4, "float32")
    y = np.ones((4, 1), "float32")
    with pytest.warns(UserWarning) as said:
        model.fit(x, y, batch_size=2, verbose=0, callbacks=[AMPMonitor(str(tmp_path))])
    messages = [str(warning.message) for warning in said]
    assert not [m for m in messages if "cannot act inside an XLA" in m]
    assert [m for m in messages if "while the loss scale was already at its" in m]
    with pytest.warns(UserWarning, match="cannot act inside an XLA-compiled"):
        model.fit(x, y, batch_size=2, verbose=0)


def test_floor_overflows_are_counted_in_every_mode():
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        initial_scale=4.0,
        min_scale=2.0,
        on_min_scale="ignore",
    )
    variable = keras.Variable([1.0])
    step = make_stepper(optimizer, variable, compiled=True)
    for value in [INF, 1.0, INF, INF]:
        step(value)
    assert int(optimizer.min_scale_overflow_count.numpy()) == 2
    assert int(optimizer.last_min_scale_overflow_step.numpy()) == 4


def test_under_xla_floor_overflows_loaded_from_a_file_are_not_acted_on_again(
    tmp_path,
):
    # The loaded floor-overflow count is not new: the first host read after
    # resuming must not raise for a step of the previous session.
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1),
        initial_scale=2.0,
        min_scale=2.0,
        on_min_scale="raise",
    )
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer, "mse", jit_compile=True)
    x = np.array([[INF, 1.0], [1.0, 1.0]], "float32")
    y = np.ones((2, 1), "float32")
    with pytest.warns(UserWarning, match="cannot act inside an XLA-compiled"):
        model.fit(x, y, batch_size=1, verbose=0, shuffle=False)
    path = str(tmp_path / "floor.keras")
    model.save(path)

    loaded = keras.saving.load_model(path)
    assert int(loaded.optimizer.min_scale_overflow_count.numpy()) == 1
    with pytest.warns(UserWarning, match="cannot act inside an XLA-compiled"):
        loaded.fit(x[1:], y[1:], batch_size=1, verbose=0)  # finite: no new hit
    loaded.optimizer.check_min_scale()  # the loaded hit is not raised again
    loaded.fit(x[:1], y[:1], batch_size=1, verbose=0)  # a new hit at the floor
    with pytest.raises(RuntimeError, match="at step 4 while the loss scale"):
        loaded.optimizer.check_min_scale()


def test_python_is_called_back_only_for_an_overflow_at_the_floor(monkeypatch):
    # No host round trip on the normal path: the "warn" callback (the only
    # py_function in the step) runs on overflows at the floor, nowhere else.
    calls = []
    warn_once = _scale_schedule._warn_once

    def counting_warn_once(optimizer, step, scale_before):
        calls.append(int(step))
        return warn_once(optimizer, step, scale_before)

    monkeypatch.setattr(_scale_schedule, "_warn_once", counting_warn_once)
    variable = keras.Variable([1.0])
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.1), initial_scale=4.0, min_scale=2.0
    )
    step = make_stepper(optimizer, variable, compiled=True)
    for value in [1.0, INF, 1.0, 1.0, 1.0]:  # finite, and one backoff 4 -> 2
        step(value)
    assert calls == []
    with pytest.warns(UserWarning, match="already at its floor"):
        step(INF)  # at the floor
    step(INF)
    assert calls == [6, 7]  # called each time; warns once

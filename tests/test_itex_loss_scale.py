"""The loss scaler and the overflow scenario, the same on both stacks.

Written against `_compat` only: on Keras 2.15 the scaler subclasses Keras 2's
`LossScaleOptimizerV3` and `fit` drives it through `minimize` /
`apply_gradients`; on Keras 3 through `apply`. The behaviour must not differ.
"""

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp_plus as kap
from keras_amp_plus import _compat
from keras_amp_plus.callbacks import _checks
from keras_amp_plus.optimizers import LossScaleOptimizer

BATCH, SAMPLES = 16, 128
STEPS_PER_EPOCH = SAMPLES // BATCH


def test_the_scaler_is_keras_own_scaler_class_on_this_stack():
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    assert isinstance(optimizer, _compat.KerasLossScaleOptimizer)
    if not _compat.IS_KERAS_3:
        from keras.src.mixed_precision.loss_scale_optimizer import (
            LossScaleOptimizerV3,
        )

        assert isinstance(optimizer, LossScaleOptimizerV3)
        # What Keras 2's compile checks before wrapping an optimizer itself.
        assert isinstance(optimizer, keras.mixed_precision.LossScaleOptimizer)


def test_compile_under_mixed_float16_keeps_our_scaler():
    _compat.set_global_policy("mixed_float16")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.1))
    model.compile(optimizer, loss="mse")
    assert model.optimizer is optimizer


def test_state_machine_step_by_step():
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.5),
        initial_scale=8.0,
        min_scale=2.0,
        dynamic_growth_steps=2,
        growth_factor=4.0,
    )
    # A model variable as each stack makes them (Keras 3's have a `path`).
    variable = keras.Variable([1.0]) if _compat.IS_KERAS_3 else tf.Variable([1.0])
    # Overflow: skipped, recorded, scale halves.
    optimizer.apply([tf.constant([float("inf")])], [variable])
    summary = optimizer.overflow_summary()
    assert summary["overflow_count"] == 1 and summary["inf_steps"] == 1
    assert summary["loss_scale"] == 4.0 and summary["last_step_skipped"]
    assert float(variable.numpy()[0]) == 1.0
    # A skipped step is no step (Keras 2's scaler counts it: so does ours there).
    assert int(optimizer.iterations.numpy()) == (0 if _compat.IS_KERAS_3 else 1)
    # NaN at the floor's doorstep: 4 -> 2 (the floor), then stays at 2.
    optimizer.apply([tf.constant([float("nan")])], [variable])
    with pytest.warns(UserWarning, match="already at its floor"):
        optimizer.apply([tf.constant([float("nan")])], [variable])
    summary = optimizer.overflow_summary()
    assert summary["nan_steps"] == 2 and summary["loss_scale"] == 2.0
    # Two finite steps: applied (gradient divided by the scale), then growth.
    optimizer.apply([tf.constant([4.0])], [variable])
    assert float(variable.numpy()[0]) == pytest.approx(1.0 - 0.5 * 4.0 / 2.0)
    optimizer.apply([tf.constant([4.0])], [variable])
    summary = optimizer.overflow_summary()
    assert summary["loss_scale"] == 8.0 and not summary["last_step_skipped"]
    assert int(optimizer.iterations.numpy()) == (2 if _compat.IS_KERAS_3 else 5)
    assert int(optimizer.total_steps.numpy()) == 5
    events = optimizer.read_events()
    assert [e["step"] for e in events] == [1, 2, 3]
    assert [e["has_nan"] for e in events] == [False, True, True]
    assert [e["scale_before"] for e in events] == [8.0, 4.0, 2.0]


def test_config_round_trip_keeps_every_argument():
    optimizer = LossScaleOptimizer(
        keras.optimizers.Adam(1e-3),
        initial_scale=256.0,
        dynamic_growth_steps=7,
        growth_factor=3.0,
        backoff_factor=0.25,
        min_scale=2.0,
        max_scale=2.0**20,
        hysteresis=2,
        on_min_scale="raise",
        event_buffer_size=9,
        name="my_scaler",
    )
    config = optimizer.get_config()
    clone = LossScaleOptimizer.from_config(config)
    assert clone.name == "my_scaler"
    for name in (
        "growth_factor",
        "backoff_factor",
        "min_scale",
        "max_scale",
        "hysteresis",
        "on_min_scale",
        "event_buffer_size",
        "dynamic_growth_steps",
    ):
        assert getattr(clone, name) == getattr(optimizer, name), name
    assert float(clone.initial_scale) == 256.0
    assert isinstance(clone.inner_optimizer, keras.optimizers.Adam)


def test_bad_arguments_raise_before_anything_is_built():
    with pytest.raises(ValueError, match=r"Received: min_scale=0"):
        LossScaleOptimizer(keras.optimizers.SGD(), min_scale=0)
    with pytest.raises(TypeError, match="already a LossScaleOptimizer"):
        LossScaleOptimizer(LossScaleOptimizer(keras.optimizers.SGD()))


def overflow_model(jit_compile=False, scaler="ours"):
    """A model whose layer `hot` overflows float16 (outputs about 1e5).

    `scaler` "keras": the stack's own `LossScaleOptimizer` (Keras 2's
    `compile` wraps any optimizer in it under `mixed_float16`).
    """
    _compat.set_global_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, name="d1")(inputs)
    h = keras.layers.Dense(
        16,
        name="hot",
        trainable=False,
        kernel_initializer=keras.initializers.RandomNormal(stddev=3e4, seed=1),
    )(h)
    # Ours on both stacks: Keras 2's own layer casts its input to float16
    # first, which overflows again after `hot` moved to float32.
    h = kap.layers.LayerNormalization(name="ln")(h)
    outputs = keras.layers.Dense(1, name="head")(h)
    model = keras.Model(inputs, outputs)
    # Inside XLA the floor action moves to the host, with a warning.
    on_min_scale = "ignore" if jit_compile else "warn"
    optimizer = LossScaleOptimizer(
        keras.optimizers.Adam(0.1), on_min_scale=on_min_scale
    )
    if scaler == "keras":
        optimizer = keras.mixed_precision.LossScaleOptimizer(keras.optimizers.Adam(0.1))
    model.compile(optimizer, loss="mse", jit_compile=jit_compile)
    return model


def test_the_scale_of_the_stacks_own_scaler_is_put_back_after_a_denial(tmp_path):
    # Keras 2's scaler keeps its scale in a private state (its `loss_scale`
    # is a tensor copy); putting it back raised AttributeError there.
    model = overflow_model(scaler="keras")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 4)).astype("float32")
    y = np.tanh(x @ np.array([[1.0], [2.0], [-1.0], [0.5]])).astype("float32")
    monitor = kap.callbacks.AMPMonitor(str(tmp_path), read_every_steps=4)
    history = model.fit(
        x, y, batch_size=BATCH, epochs=2, shuffle=False, verbose=0, callbacks=[monitor]
    )
    assert model.get_layer("hot").compute_dtype == "float32"
    with open(os.path.join(str(tmp_path), "amp_events.jsonl")) as f:
        records = [json.loads(line) for line in f]
    restored = [r for r in records if r["type"] == "scale_restored"]
    assert [(r["epoch"], r["to"]) for r in restored] == [(0, 2.0**15)]
    assert history.history["loss_scale"][0] == 2.0**15
    assert np.isfinite(history.history["loss"][1])


@pytest.mark.slow
@pytest.mark.parametrize("jit_compile", [False, True])
def test_float16_overflow_is_attributed_denied_and_training_recovers(
    tmp_path, jit_compile
):
    # Under XLA: Keras 3 compiles the step in the monitor's graph step, Keras 2
    # compiles the whole step, the batch's stash included.
    log_dir = str(tmp_path / "logs")
    model = overflow_model(jit_compile)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 4)).astype("float32")
    y = np.tanh(x @ np.array([[1.0], [2.0], [-1.0], [0.5]])).astype("float32")
    monitor = kap.callbacks.AMPMonitor(log_dir, read_every_steps=4, patience=10)
    history = model.fit(
        x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0, callbacks=[monitor]
    )

    # Every step of epoch 0 overflows (skipped); then `hot` runs in float32
    # and the scale is put back to 2**15, from where the scaler may search
    # again (backward overflows above trusted_backward_scale: not attributed).
    assert history.history["overflow_events"][0] == STEPS_PER_EPOCH
    with open(os.path.join(log_dir, "amp_events.jsonl")) as f:
        records = [json.loads(line) for line in f]
    later = [r for r in records if r["type"] == "overflow" and r["epoch"] > 0]
    assert not any(r["trusted"] for r in later)
    restored = [r for r in records if r["type"] == "scale_restored"]
    assert [(r["epoch"], r["to"]) for r in restored] == [(0, 2.0**15)]
    events = [r for r in records if r["type"] == "overflow" and r["epoch"] == 0]
    assert [e["step"] for e in events] == list(range(1, STEPS_PER_EPOCH + 1))
    assert all(e["layers"] == ["hot"] and e["direction"] == "forward" for e in events)
    assert [e["scale_before"] for e in events] == [2.0 ** (15 - i) for i in range(8)]
    changes = [r for r in records if r["type"] == "list_change"]
    assert [(c["kind"], c["name"], c["to"]) for c in changes] == [
        ("layer", "hot", "deny")
    ]
    assert model.get_layer("hot").compute_dtype == "float32"
    assert model.get_layer("d1").compute_dtype == "float16"
    losses = history.history["loss"]
    assert np.isfinite(losses[1:]).all() and losses[-1] < losses[1]
    summary = model.optimizer.overflow_summary()
    assert summary["overflow_count"] == sum(history.history["overflow_events"])
    assert summary["by_variable"]["d1/kernel"] >= STEPS_PER_EPOCH


def _unscaled_warnings(caplog, optimizer):
    """Return the monitor's float16-unscaled warnings for a model on `optimizer`."""
    _compat.set_global_policy("mixed_float16")
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer, loss="mse")
    with caplog.at_level("WARNING", logger="keras_amp_plus"):
        for _ in range(2):  # as two fits check it
            _checks.warn_if_float16_is_unscaled(model)
    return [
        r.getMessage()
        for r in caplog.records
        if "computes in float16" in r.getMessage()
    ]


@pytest.mark.skipif(
    _compat.IS_KERAS_3,
    reason="Keras 3's LossScaleOptimizer has no fixed scale (always dynamic)",
)
@pytest.mark.parametrize("scale, warned", [(1.0, True), (1024.0, False)])
def test_keras2_fixed_loss_scale_of_one_under_float16_is_named(caplog, scale, warned):
    optimizer = keras.mixed_precision.LossScaleOptimizer(
        keras.optimizers.SGD(0.1), dynamic=False, initial_scale=scale
    )
    warnings = _unscaled_warnings(caplog, optimizer)
    if warned:
        assert len(warnings) == 1  # once per optimizer, not at every fit
        assert "Keras's fixed loss scale of 1 (dynamic=False)" in warnings[0]
        assert "or pass `dynamic=True`" in warnings[0]
    else:
        assert warnings == []


def test_keras_dynamic_loss_scale_under_float16_is_not_warned_of(caplog):
    optimizer = _compat.KerasLossScaleOptimizer
    if isinstance(optimizer, tuple):
        optimizer = optimizer[0]
    assert _unscaled_warnings(caplog, optimizer(keras.optimizers.SGD(0.1))) == []


def test_records_and_scale_survive_a_keras_file(tmp_path):
    _compat.set_global_policy("mixed_float16")
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1, name="d")])
    model.compile(
        LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=64.0), loss="mse"
    )
    x = np.array([[1.0, 2.0], [3.0, 4.0]], "float32")
    model.train_on_batch(x, np.array([[1.0], [2.0]], "float32"))
    model.train_on_batch(x, np.array([[np.inf], [2.0]], "float32"))  # overflow
    before = model.optimizer.overflow_summary()
    assert before["overflow_count"] == 1 and before["loss_scale"] == 32.0
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.models.load_model(path)
    assert type(loaded.optimizer) is LossScaleOptimizer
    after = loaded.optimizer.overflow_summary()
    # Keras 3 may prefix the loaded variables' paths with the model's name.
    assert list(after.pop("by_variable").values()) == [1, 1]
    assert list(before.pop("by_variable").values()) == [1, 1]
    assert after == before
    assert int(loaded.optimizer.total_steps.numpy()) == 2


@pytest.mark.parametrize("with_input", [True, False], ids=["input", "no input"])
def test_replay_names_the_nested_layer_whose_cast_overflowed(with_input):
    # Keras 2.15 too: the first layer inside a nested model whose float16
    # cast of the model's finite inputs overflowed is named (`input_cast`);
    # values that go bad between the layers name the container.
    from keras_amp_plus.callbacks import _attribution

    _compat.set_global_policy("mixed_float16")
    try:
        inner = [keras.layers.Dense(2, name="first"), keras.layers.Dense(2)]
        if with_input:
            inner.insert(0, keras.Input((2,)))
        backbone = keras.Sequential(inner, name="backbone")
        model = keras.Sequential([keras.Input((2,)), backbone])
        index = _attribution.LayerIndex(model)
        big = np.full((1, 2), 1e6, "float32")  # finite, beyond float16
        found = _attribution.find_forward_overflow(
            model, (big,), index.layers, index.chain
        )
        assert found["reason"] == "input_cast"
        assert found["layer"] in ("backbone/first", "backbone")
        if with_input:
            assert found["layer"] == "backbone/first"
        first = backbone.get_layer("first")
        first.kernel.assign(np.full((2, 2), 1e5, "float32"))
        found = _attribution.find_forward_overflow(
            model, (np.ones((1, 2), "float32"),), index.layers, index.chain
        )
        assert found == {"layer": "backbone/first", "reason": "output"}
    finally:
        _compat.set_global_policy("float32")


@pytest.mark.itex
@pytest.mark.parametrize("scale", [1024.0, 1000.0])
@pytest.mark.parametrize("clip", [False, True])
def test_a_custom_loop_of_the_tf_keras_guide_updates_as_keras_scaler(clip, scale):
    # Keras 2's contract: `get_unscaled_gradients` returns the true gradients
    # (users clip or log them), `apply_gradients` applies them as they are.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 4)).astype("float32")
    y = rng.normal(size=(8, 3)).astype("float32")
    kernel = rng.normal(size=(4, 3)).astype("float32")
    true_grad = 2 * x.astype("float64").T @ (x @ kernel - y) / y.size
    kernels = []
    for make in (LossScaleOptimizer, keras.mixed_precision.LossScaleOptimizer):
        variable = tf.Variable(kernel)
        optimizer = make(keras.optimizers.SGD(0.1), initial_scale=scale)
        with tf.GradientTape() as tape:
            loss = tf.reduce_mean(tf.square(tf.matmul(x, variable) - y))
            scaled = optimizer.get_scaled_loss(loss)
        (grad,) = optimizer.get_unscaled_gradients(tape.gradient(scaled, [variable]))
        np.testing.assert_allclose(grad.numpy(), true_grad, rtol=1e-5)
        if clip:
            (grad,), _ = tf.clip_by_global_norm([grad], 0.5)
        optimizer.apply_gradients([(grad, variable)])
        kernels.append(variable.numpy())
    np.testing.assert_array_equal(kernels[0], kernels[1])
    step = true_grad * (min(1.0, 0.5 / np.linalg.norm(true_grad)) if clip else 1.0)
    np.testing.assert_allclose(kernels[0], kernel - 0.1 * step, rtol=1e-5, atol=1e-7)


@pytest.mark.itex
def test_keras_2_legacy_optimizers_are_refused_with_the_fix():
    with pytest.raises(TypeError, match=r"legacy optimizers .* not supported"):
        LossScaleOptimizer(keras.optimizers.legacy.Adam())
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    model.compile(keras.optimizers.legacy.Adam(), "mse")  # Keras wraps its scaler
    kernel = model.layers[0].kernel.numpy()
    x, y = np.ones((8, 4), "float32"), np.ones((8, 1), "float32")
    with pytest.raises(ValueError, match=r"legacy optimizers .* not supported") as info:
        model.fit(x, y, verbose=0, callbacks=[kap.callbacks.AMPMonitor(None)])
    # The user's optimizer is named, not only the scaler Keras wrapped it in.
    assert "Received: optimizer=keras.src.optimizers.legacy.adam.Adam (wrapped in " in (
        str(info.value)
    )
    np.testing.assert_array_equal(model.layers[0].kernel.numpy(), kernel)


@pytest.mark.itex
@pytest.mark.parametrize("loop", ["fit", "custom"])
def test_float16_variables_train_at_scales_beyond_float16_as_keras_scaler(loop):
    # 65536 is infinite in float16; its reciprocal is not. Small gradients
    # (inputs of 0.01) stay finite scaled; the loss is float32.
    kernels = []
    for make in (LossScaleOptimizer, keras.mixed_precision.LossScaleOptimizer):
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((4,)),
                keras.layers.Dense(2, dtype="float16"),
                keras.layers.Activation("linear", dtype="float32"),
            ]
        )
        optimizer = make(keras.optimizers.SGD(1.0), initial_scale=2.0**16)
        x, y = np.full((8, 4), 0.01, "float32"), np.zeros((8, 2), "float32")
        if loop == "fit":
            model.compile(optimizer, "mse")
            model.fit(x, y, batch_size=8, verbose=0)
        else:
            with tf.GradientTape() as tape:
                loss = tf.reduce_mean(tf.square(model(x) - y))
                scaled = optimizer.get_scaled_loss(loss)
            grads = tape.gradient(scaled, model.trainable_variables)
            assert all(np.isfinite(g.numpy()).all() for g in grads)
            grads = optimizer.get_unscaled_gradients(grads)
            optimizer.apply_gradients(
                zip(grads, model.trainable_variables, strict=True)
            )
        assert int(optimizer.iterations.numpy()) == 1  # applied, not skipped
        kernels.append(model.layers[0].kernel.numpy())
    np.testing.assert_array_equal(kernels[0], kernels[1])


@pytest.mark.itex
def test_keras_2_skipped_steps_count_in_iterations_as_keras_2s_scaler():
    # Keras 2's scaler adds one to `iterations` on a skipped step: Adam's
    # bias correction and learning-rate schedules count it, so the weights
    # after an overflow match Keras's run only if ours counts it too.
    keras.mixed_precision.set_global_policy("mixed_float16")
    x = np.random.default_rng(0).normal(size=(128, 8)).astype("float32")
    x[32:64, 0] = 7e4  # batch 1 of each epoch overflows
    y = (x[:, 1] > 0).astype("int64")
    results = []
    for make in (keras.mixed_precision.LossScaleOptimizer, LossScaleOptimizer):
        tf.keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [
                keras.Input((8,)),
                keras.layers.Dense(16),
                keras.layers.Dense(2, dtype="float32"),
            ]
        )
        optimizer = make(keras.optimizers.Adam(1e-2))
        model.compile(
            optimizer, keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        )
        model.fit(x, y, epochs=2, batch_size=32, shuffle=False, verbose=0)
        results.append((int(optimizer.iterations), model.get_weights()))
    (keras_iterations, keras_weights), (our_iterations, our_weights) = results
    assert our_iterations == keras_iterations == 8
    for ours, theirs in zip(our_weights, keras_weights, strict=True):
        np.testing.assert_array_equal(ours, theirs)

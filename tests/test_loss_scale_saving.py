"""Config round trips; .keras files, checkpoints and backups keep the records."""

import warnings

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_amp_plus.optimizers import LossScaleOptimizer

NON_DEFAULT_ARGS = dict(
    initial_scale=64.0,
    dynamic_growth_steps=3,
    growth_factor=4.0,
    backoff_factor=0.25,
    min_scale=2.0,
    max_scale=1024.0,
    hysteresis=2,
    on_min_scale="ignore",
    event_buffer_size=5,
    name="scaler",
)


def test_get_config_from_config_keeps_every_argument():
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(0.01), **NON_DEFAULT_ARGS)
    config = optimizer.get_config()
    for key, value in NON_DEFAULT_ARGS.items():
        assert config[key] == value, key
    restored = LossScaleOptimizer.from_config(config)
    assert "inner_optimizer" in config  # from_config does not consume the dict
    assert restored.get_config() == config
    assert isinstance(restored.inner_optimizer, keras.optimizers.Adam)

    serialized = keras.saving.serialize_keras_object(optimizer)
    assert serialized["registered_name"] == "keras_amp_plus>LossScaleOptimizer"
    again = keras.saving.deserialize_keras_object(serialized)
    assert type(again) is LossScaleOptimizer
    assert again.get_config() == config


def test_guard_round_trips_as_a_fixed_scale_of_one():
    guard = LossScaleOptimizer.guard(keras.optimizers.SGD(), event_buffer_size=7)
    restored = LossScaleOptimizer.from_config(guard.get_config())
    assert (restored.initial_scale, restored.min_scale, restored.max_scale) == (1, 1, 1)
    assert restored.on_min_scale == "ignore"
    assert restored.event_buffer_size == 7


def make_trained_model():
    """A model trained for 6 steps, 2 of which overflow (NaN inputs)."""
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, name="hidden"), keras.layers.Dense(1)]
    )
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(0.01), **NON_DEFAULT_ARGS)
    model.compile(optimizer, "mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(12, 3)).astype("float32")
    y = rng.normal(size=(12, 1)).astype("float32")
    x[2, 0] = x[8, 1] = np.nan
    model.fit(x, y, batch_size=2, epochs=1, verbose=0, shuffle=False)
    return model, optimizer


def record_state(optimizer):
    """Everything the scaler saves; variables by column (paths depend on names)."""
    state = optimizer.overflow_summary()
    paths = optimizer.tracked_variable_paths()
    state["by_variable"] = [state["by_variable"][p] for p in paths]
    state["step_counter"] = int(optimizer.step_counter.numpy())
    state["total_steps"] = int(optimizer.total_steps.numpy())
    state["iterations"] = int(optimizer.iterations.numpy())
    state["events"] = optimizer.read_events(0)
    for event in state["events"]:
        event["variables"] = [paths.index(p) for p in event["variables"]]
    return state


def continue_training(model):
    rng = np.random.default_rng(5)
    x = rng.normal(size=(8, 3)).astype("float32")
    y = rng.normal(size=(8, 1)).astype("float32")
    x[4, 2] = np.inf
    model.fit(x, y, batch_size=2, epochs=1, verbose=0, shuffle=False)
    return [w.numpy() for w in model.weights]


def test_keras_file_restores_scale_and_counters_and_training_continues(tmp_path):
    model, optimizer = make_trained_model()
    state = record_state(optimizer)
    assert state["overflow_count"] == 2 and state["nan_steps"] == 2
    path = str(tmp_path / "model.keras")
    model.save(path)

    loaded = keras.saving.load_model(path)
    assert type(loaded.optimizer) is LossScaleOptimizer
    assert record_state(loaded.optimizer) == state

    weights_original = continue_training(model)
    weights_loaded = continue_training(loaded)
    for a, b in zip(weights_original, weights_loaded, strict=True):
        np.testing.assert_array_equal(a, b)
    assert record_state(loaded.optimizer) == record_state(optimizer)
    assert record_state(optimizer)["overflow_count"] == 3


def test_tf_checkpoint_restores_the_records(tmp_path):
    model, optimizer = make_trained_model()
    state = record_state(optimizer)
    checkpoint = tf.train.Checkpoint(model=model, optimizer=optimizer)
    saved = checkpoint.save(str(tmp_path / "ckpt"))
    continue_training(model)
    assert record_state(optimizer) != state
    checkpoint.restore(saved).assert_consumed()
    assert record_state(optimizer) == state


def test_backup_and_restore_brings_back_the_records(tmp_path):
    backup_dir = str(tmp_path / "backup")
    model, optimizer = make_trained_model()
    rng = np.random.default_rng(1)
    x = rng.normal(size=(4, 3)).astype("float32")
    y = rng.normal(size=(4, 1)).astype("float32")
    x[0, 0] = np.nan
    backup = keras.callbacks.BackupAndRestore(backup_dir, delete_checkpoint=False)
    model.fit(x, y, batch_size=2, epochs=1, verbose=0, callbacks=[backup])
    state = record_state(optimizer)

    fresh_model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, name="hidden"), keras.layers.Dense(1)]
    )
    fresh = LossScaleOptimizer(keras.optimizers.Adam(0.01), **NON_DEFAULT_ARGS)
    fresh_model.compile(fresh, "mse")
    restore = keras.callbacks.BackupAndRestore(backup_dir, delete_checkpoint=False)
    # The backup says epoch 1 is done: fit restores it and trains nothing more.
    fresh_model.fit(x, y, batch_size=2, epochs=1, verbose=0, callbacks=[restore])
    assert record_state(fresh) == state
    assert state["overflow_count"] == 3


def test_wrapped_ring_buffer_survives_save_and_load(tmp_path):
    # 5 overflow events in a 2-slot ring: after reload, reading from the last
    # seen count gives the same events, and new events land in the same slots.
    keras.utils.set_random_seed(2)
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.01),
        initial_scale=2.0**10,
        event_buffer_size=2,
        on_min_scale="ignore",
    )
    model.compile(optimizer, "mse")
    x = np.ones((8, 2), "float32")
    x[[0, 2, 3, 5, 7], 0] = np.inf
    y = np.zeros((8, 1), "float32")
    model.fit(x, y, batch_size=1, epochs=1, verbose=0, shuffle=False)
    path = str(tmp_path / "wrapped.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)

    def without_paths(events):
        return [{k: v for k, v in e.items() if k != "variables"} for e in events]

    held = optimizer.read_events(3)
    assert [(e["index"], e["step"]) for e in held] == [(4, 6), (5, 8)]
    assert without_paths(loaded.optimizer.read_events(3)) == without_paths(held)
    for trained in (model, loaded):
        trained.fit(x[:3], y[:3], batch_size=1, epochs=1, verbose=0, shuffle=False)
    after = loaded.optimizer.read_events(5)
    assert [(e["index"], e["step"]) for e in after] == [(6, 9), (7, 11)]
    assert without_paths(after) == without_paths(optimizer.read_events(5))
    assert loaded.optimizer.event_steps.numpy().tolist() == [11, 9]


def test_a_keras_scaler_file_loads_into_ours_with_its_scale_and_counters(tmp_path):
    keras.config.set_dtype_policy("mixed_float16")

    def build():
        keras.utils.set_random_seed(0)
        inputs = keras.Input((4,))
        return keras.Model(inputs, keras.layers.Dense(1)(inputs))

    x, y = np.ones((16, 4), "float32"), np.ones((16, 1), "float32")
    theirs = build()
    keras_scaler = keras.optimizers.LossScaleOptimizer(
        keras.optimizers.Adam(), initial_scale=2.0**10
    )
    theirs.compile(keras_scaler, "mse")
    theirs.fit(x, y, batch_size=4, epochs=2, verbose=0)
    keras_scaler.dynamic_scale.assign(2.0**7)  # as after a few overflows
    path = str(tmp_path / "keras_scaler.keras")
    theirs.save(path)

    ours = build()
    optimizer = LossScaleOptimizer(keras.optimizers.Adam())
    ours.compile(optimizer, "mse")
    optimizer.build(ours.trainable_variables)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "Skipping variable loading"
        ours.load_weights(path)
    assert float(optimizer.dynamic_scale.numpy()) == 2.0**7
    assert int(optimizer.step_counter.numpy()) == int(keras_scaler.step_counter.numpy())
    assert int(optimizer.iterations.numpy()) == 8
    for a, b in zip(
        optimizer.inner_optimizer.variables,
        keras_scaler.inner_optimizer.variables,
        strict=True,
    ):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert int(optimizer.overflow_count.numpy()) == 0


def test_a_file_of_the_first_record_layout_loads_every_record_it_holds():
    # Files saved before the loss-state record existed: same variables in the
    # same order, without `event_loss_states`.
    model, optimizer = make_trained_model()
    state = record_state(optimizer)
    current = {}
    optimizer.save_own_variables(current)
    loss_states_column = next(
        i for i, v in enumerate(optimizer.variables) if v is optimizer.event_loss_states
    )
    values = [current[str(i)] for i in range(len(current))]
    del values[loss_states_column]
    first_layout = {str(i): value for i, value in enumerate(values)}

    fresh = LossScaleOptimizer(keras.optimizers.Adam(0.01), **NON_DEFAULT_ARGS)
    fresh.build(model.trainable_variables)
    fresh.load_own_variables(first_layout)

    assert state["overflow_count"] == 2
    assert record_state(fresh) == state
    # NaN inputs: the loss itself was not finite.
    assert [r.loss_finite for r in optimizer.read_records(0)] == [False, False]
    # Not recorded in that layout: "not seen", not "finite".
    assert [r.loss_finite for r in fresh.read_records(0)] == [None, None]


@pytest.mark.parametrize("capacity", [2, 3, 8], ids=["smaller", "same", "larger"])
def test_weights_load_into_a_scaler_with_another_event_buffer_size(tmp_path, capacity):
    # The scaler's warning advises raising `event_buffer_size`; a job resumed
    # with it must get back its scale, counters, inner state and newest events.
    def model_with(buffer_size):
        keras.utils.set_random_seed(2)
        model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
        optimizer = LossScaleOptimizer(
            keras.optimizers.Adam(0.01),
            initial_scale=2.0**10,
            event_buffer_size=buffer_size,
            on_min_scale="ignore",
        )
        model.compile(optimizer, "mse")
        optimizer.build(model.trainable_variables)
        return model

    x = np.ones((8, 2), "float32")
    x[[0, 2, 3, 5, 7], 0] = np.inf
    y = np.zeros((8, 1), "float32")
    saved = model_with(3)
    saved.fit(x, y, batch_size=1, epochs=1, verbose=0, shuffle=False)
    path = str(tmp_path / "saved.weights.h5")
    saved.save_weights(path)
    loaded = model_with(capacity)
    loaded.load_weights(path)
    old, new = saved.optimizer, loaded.optimizer
    assert float(new.dynamic_scale.numpy()) == float(old.dynamic_scale.numpy())
    summaries = [o.overflow_summary() for o in (old, new)]
    for summary in summaries:  # the models' own names differ
        summary["by_variable"] = list(summary["by_variable"].values())
    assert summaries[0] == summaries[1]
    assert int(new.iterations.numpy()) == int(old.iterations.numpy())
    for before, after in zip(saved.weights, loaded.weights, strict=True):
        np.testing.assert_array_equal(before.numpy(), after.numpy())
    # The newest events both rings hold (of 5, at steps 1, 3, 4, 6, 8).
    kept = min(3, capacity)

    def without_paths(events):
        return [{k: v for k, v in e.items() if k != "variables"} for e in events]

    events = without_paths(new.read_events(5 - kept))
    assert [e["step"] for e in events] == [4, 6, 8][3 - kept :]
    assert events == without_paths(old.read_events(5 - kept))
    # Read from the start, the events lost before the save are said lost
    # (a larger ring has empty slots, not events at step 0).
    with pytest.warns(UserWarning, match=f"{5 - kept} overflow events were overwr"):
        assert without_paths(new.read_events(0)) == events

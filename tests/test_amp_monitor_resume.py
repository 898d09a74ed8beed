"""Nothing lost: BackupAndRestore resumes, model.save/load_model, get_config."""

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import (
    BATCH,
    STEPS_PER_EPOCH,
    overflow_model,
    read_jsonl,
    read_tensorboard,
    regression_data,
    scalar_series,
    train,
)

from keras_amp_plus.callbacks import AMPMonitor
from keras_amp_plus.optimizers import LossScaleOptimizer


class Interrupt(keras.callbacks.Callback):
    """Raise `error` in the middle of epoch `epoch`, after the monitor's reads.

    Outside the step: a callback's error, or `KeyboardInterrupt` as Ctrl-C
    landing between two steps.
    """

    def __init__(self, epoch, batch, error=None):
        super().__init__()
        self.epoch, self.batch = epoch, batch
        self.error = RuntimeError("interrupted") if error is None else error
        self.current = None

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.current == self.epoch and batch == self.batch:
            raise self.error


def run(log_dir, backup_dir, adapt, interrupt=None, epochs=4):
    model = overflow_model("mixed_float16", on_min_scale="ignore")
    monitor = AMPMonitor(log_dir, adapt=adapt, read_every_steps=2)
    callbacks = [monitor, keras.callbacks.BackupAndRestore(backup_dir)]
    if interrupt is not None:
        callbacks.append(interrupt)
    history = train(model, callbacks, epochs=epochs)
    return model, monitor, history


@pytest.mark.parametrize("adapt", [False, True])
def test_resumed_fit_matches_uninterrupted(tmp_path, adapt):
    # Interrupted in epoch 1 (adapt=True: after `hot` moved in epoch 0; adapt=False:
    # after some of epoch 1's events were already written to the jsonl file).
    log_dir, backup = str(tmp_path / "logs"), str(tmp_path / "backup")
    with pytest.raises(RuntimeError, match="interrupted"):
        run(log_dir, backup, adapt, Interrupt(epoch=1, batch=4))
    partial = read_jsonl(log_dir)
    # Attributed events only: after a denial the scaler may search again.
    assert (
        any(
            r["type"] == "overflow" and r["epoch"] == 1 and r["trusted"]
            for r in partial
        )
        != adapt
    )
    model, monitor, history = run(log_dir, backup, adapt)
    assert len(history.history["loss"]) == 3  # epochs 1, 2, 3 only

    reference_dir = str(tmp_path / "reference")
    ref_model, ref_monitor, _ = run(reference_dir, str(tmp_path / "b2"), adapt)
    assert read_jsonl(log_dir) == read_jsonl(reference_dir)
    assert monitor.lists == ref_monitor.lists
    expected_deny = ("hot",) if adapt else ()
    assert monitor.lists.deny_layers == expected_deny
    for trained in (model, ref_model):
        assert trained.get_layer("hot").compute_dtype == (
            "float32" if adapt else "float16"
        )
    overflow = [r for r in read_jsonl(log_dir) if r["type"] == "overflow"]
    steps = [r["step"] for r in overflow]
    assert len(steps) == len(set(steps))  # no event counted twice
    attributed = [r for r in overflow if r["trusted"]]
    assert len(attributed) == (STEPS_PER_EPOCH if adapt else 4 * STEPS_PER_EPOCH)
    # The lists in force from epoch 1 (with adapt=True written when they
    # changed, at the end of epoch 0) are written there once.
    lists_steps = [e.step for e in read_tensorboard(log_dir).Tensors("amp/lists")]
    assert lists_steps == [0, 1]


def test_lists_survive_save_and_load(tmp_path):
    model = overflow_model("mixed_float16")
    monitor = AMPMonitor(str(tmp_path / "logs"), read_every_steps=4)
    train(model, [monitor], epochs=2)
    path = str(tmp_path / "model.keras")
    model.save(path)
    loaded = keras.saving.load_model(path)
    dtypes = {layer.name: layer.compute_dtype for layer in loaded.layers[1:]}
    assert dtypes == {
        "d1": "float16",
        "hot": "float32",
        "ln": "float16",
        "head": "float16",
    }
    # The monitor's config carries the current lists; a new monitor on the
    # loaded model continues the record without new overflows.
    config = monitor.get_config()
    again = AMPMonitor.from_config(config)
    assert again.lists == monitor.lists and again.lists.deny_layers == ("hot",)
    x, y = regression_data()
    history = loaded.fit(
        x, y, batch_size=16, epochs=3, initial_epoch=2, verbose=0, callbacks=[again]
    )
    assert history.history["overflow_events"] == [0]
    assert os.path.exists(os.path.join(str(tmp_path / "logs"), "amp_state.json"))
    changes = [
        r for r in read_jsonl(str(tmp_path / "logs")) if r["type"] == "list_change"
    ]
    assert len(changes) == 1  # the epoch-0 move, kept; nothing new


def _one_overflow_an_epoch():
    """A float16 model and data of 4 batches, one of which overflows every epoch."""
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(8), keras.layers.Dense(1)]
    )
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.01))
    model.compile(optimizer, loss="mse")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype("float32")
    x[3] *= 1e6  # beyond float16: batch 0's gradients overflow, every epoch
    return model, (x, rng.normal(size=(64, 1)).astype("float32"))


def _fit(model, data, callbacks, **kwargs):
    x, y = data
    kwargs = {"batch_size": 16, "shuffle": False, "verbose": 0, **kwargs}
    return model.fit(x, y, callbacks=callbacks, **kwargs)


def _overflow_steps(log_dir):
    return [e["step"] for e in read_jsonl(log_dir) if e["type"] == "overflow"]


def test_continuing_from_an_earlier_checkpoint_loses_no_event(tmp_path):
    # The best checkpoint (`save_best_only`) is older than the last epoch:
    # its optimizer has counted fewer overflows and steps than the monitor's
    # record of the run it continues. Every new overflow is still reported,
    # numbered after the record's steps.
    log_dir = str(tmp_path)
    model, data = _one_overflow_an_epoch()
    checkpoint = keras.callbacks.ModelCheckpoint(
        os.path.join(log_dir, "epoch{epoch}.keras")
    )
    _fit(model, data, [AMPMonitor(log_dir, adapt=False), checkpoint], epochs=4)
    reloaded = keras.saving.load_model(os.path.join(log_dir, "epoch2.keras"))
    before = int(reloaded.optimizer.overflow_count.numpy())
    monitor = AMPMonitor(log_dir, adapt=False)
    history = _fit(reloaded, data, [monitor], epochs=6, initial_epoch=4)
    assert int(reloaded.optimizer.overflow_count.numpy()) - before == 2
    assert history.history["overflow_events"] == [1, 1]
    # 4 steps an epoch: the overflowing first step of each epoch.
    assert _overflow_steps(log_dir) == [1, 5, 9, 13, 17, 21]


def test_one_monitor_for_two_models_reports_each_models_events(tmp_path):
    log_dir = str(tmp_path)
    monitor = AMPMonitor(log_dir, adapt=False)
    for _ in range(2):
        model, data = _one_overflow_an_epoch()
        history = _fit(model, data, [monitor], epochs=2)
        assert history.history["overflow_events"] == [1, 1]
    # Each model is a run of its own, its steps numbered from its start.
    runs = [
        (e["run"], e["step"]) for e in read_jsonl(log_dir) if e["type"] == "overflow"
    ]
    assert runs == [(1, 1), (1, 5), (2, 1), (2, 5)]


def _breaking_data(epoch, step):
    """The training data as a pipeline whose batch `step` of `epoch` raises."""
    x, y = regression_data()

    def batches():
        for current in range(epoch + 1):
            for index in range(STEPS_PER_EPOCH):
                if (current, index) == (epoch, step):
                    raise RuntimeError("a broken record")
                rows = slice(index * BATCH, (index + 1) * BATCH)
                yield x[rows], y[rows]

    signature = (tf.TensorSpec((BATCH, 4)), tf.TensorSpec((BATCH, 1)))
    return tf.data.Dataset.from_generator(batches, output_signature=signature)


def test_a_fit_stopped_by_an_error_in_a_step_writes_its_unread_events(tmp_path):
    # `hot` overflows on every step; the data breaks at step 4 of epoch 1,
    # before the monitor's read (every 64 steps, at the epoch end): the
    # events of steps 9-11 were only in the scaler's records.
    log_dir = str(tmp_path)
    model = overflow_model("mixed_float16", on_min_scale="ignore")
    data = _breaking_data(epoch=1, step=3)
    monitor = AMPMonitor(log_dir, adapt=False)
    with pytest.raises(Exception, match="a broken record"):
        model.fit(
            data,
            epochs=2,
            steps_per_epoch=STEPS_PER_EPOCH,
            shuffle=False,
            verbose=0,
            callbacks=[monitor],
        )
    events = [r for r in read_jsonl(log_dir) if r["type"] == "overflow"]
    ran = STEPS_PER_EPOCH + 3
    assert [r["step"] for r in events] == list(range(1, ran + 1))
    assert [r["epoch"] for r in events[STEPS_PER_EPOCH:]] == [1, 1, 1]
    skipped = scalar_series(read_tensorboard(log_dir), "amp/skipped_steps")
    assert max(skipped.values()) == ran
    # The monitor's next `fit` continues from the last completed epoch, as a
    # resumed one does: it replaces the interrupted epoch's lines.
    train(model, [monitor], epochs=1)
    events = [r for r in read_jsonl(log_dir) if r["type"] == "overflow"]
    later = events[STEPS_PER_EPOCH:]
    assert [r["step"] for r in events[:STEPS_PER_EPOCH]] == list(
        range(1, STEPS_PER_EPOCH + 1)
    )
    assert later and [r["step"] for r in later] == list(
        range(STEPS_PER_EPOCH + 1, STEPS_PER_EPOCH + 1 + len(later))
    )
    assert all(r["epoch"] == 1 for r in later)


def test_the_same_monitor_resumes_exactly_after_an_error_in_a_step(tmp_path):
    # A broken record stops `fit` inside a step of epoch 1; fixed, the same
    # cell runs again: BackupAndRestore restarts at epoch 1 with the same
    # monitor object, whose record must be the last saved epoch's.
    log_dir, backup = str(tmp_path / "logs"), str(tmp_path / "backup")
    model = overflow_model("mixed_float16", on_min_scale="ignore")
    monitor = AMPMonitor(log_dir, adapt=False, read_every_steps=2)
    callbacks = [monitor, keras.callbacks.BackupAndRestore(backup)]
    with pytest.raises(Exception, match="a broken record"):
        model.fit(
            _breaking_data(epoch=1, step=5),
            epochs=3,
            steps_per_epoch=STEPS_PER_EPOCH,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )
    train(model, callbacks, epochs=3)
    reference_dir = str(tmp_path / "reference")
    run(reference_dir, str(tmp_path / "b2"), adapt=False, epochs=3)
    assert read_jsonl(log_dir) == read_jsonl(reference_dir)


def _fit_breaking(model, monitor, epoch, step):
    with pytest.raises(Exception, match="a broken record"):
        model.fit(
            _breaking_data(epoch=epoch, step=step),
            epochs=epoch + 1,
            steps_per_epoch=STEPS_PER_EPOCH,
            shuffle=False,
            verbose=0,
            callbacks=[monitor],
        )


def test_a_run_stopped_in_its_first_epoch_keeps_its_number_and_steps(tmp_path):
    log_dir = str(tmp_path)
    model = overflow_model("mixed_float16", on_min_scale="ignore")
    train(model, [AMPMonitor(log_dir, adapt=False)], epochs=2)
    _fit_breaking(model, AMPMonitor(log_dir, adapt=False), epoch=0, step=3)
    monitor = AMPMonitor(log_dir, adapt=False)
    train(model, [monitor], epochs=1)
    assert monitor.state.run == 3
    runs = [r["run"] for r in read_jsonl(log_dir) if r["type"] == "overflow"]
    assert runs == [1] * 2 * STEPS_PER_EPOCH + [2] * 3 + [3] * STEPS_PER_EPOCH
    # Every step on one TensorBoard axis: the stopped run's 3 steps included.
    skipped = scalar_series(read_tensorboard(log_dir), "amp/skipped_steps")
    assert list(skipped) == sorted(skipped)
    assert list(skipped.values()) == [
        STEPS_PER_EPOCH,
        2 * STEPS_PER_EPOCH,
        2 * STEPS_PER_EPOCH + 3,
        3 * STEPS_PER_EPOCH + 3,
    ]


def test_a_fit_stopped_in_its_first_epoch_leaves_the_epoch_numbers(tmp_path):
    # The same monitor's later `fit`s number epochs after the earlier ones'
    # (as TensorBoard's callback does), a stopped one changing nothing.
    log_dir = str(tmp_path)
    model = overflow_model("mixed_float16", on_min_scale="ignore")
    monitor = AMPMonitor(log_dir, adapt=False)
    train(model, [monitor], epochs=2)
    _fit_breaking(model, monitor, epoch=0, step=3)
    train(model, [monitor], epochs=1)
    events = [r for r in read_jsonl(log_dir) if r["type"] == "overflow"]
    assert [r["epoch"] for r in events] == [0] * STEPS_PER_EPOCH + [
        1
    ] * STEPS_PER_EPOCH + [2] * STEPS_PER_EPOCH
    assert monitor.state.epoch_offset == 2


def test_a_run_killed_in_its_first_epoch_is_not_numbered_again(tmp_path):
    # A killed process saves no state, but its lines are in the events file:
    # the job restarted (nothing for BackupAndRestore to resume) is a new run.
    log_dir = tmp_path / "logs"
    log_dir.mkdir()
    killed = {"type": "overflow", "run": 1, "epoch": 0, "step": 1, "layers": []}
    (log_dir / "amp_events.jsonl").write_text(json.dumps(killed) + "\n")
    model = overflow_model("mixed_float16", on_min_scale="ignore")
    monitor = AMPMonitor(str(log_dir), adapt=False)
    train(model, [monitor], epochs=1)
    assert monitor.state.run == 2
    records = read_jsonl(str(log_dir))
    assert records[0] == killed
    assert {r["run"] for r in records[1:]} == {2}


def test_a_fit_stopped_by_a_callback_ends_at_the_next_fit_of_its_model(
    tmp_path, caplog
):
    # Keras runs no `on_train_end`: the monitor ends that `fit` when the model
    # is trained again, as a step's exception would have ended it.
    log_dir = str(tmp_path)
    model = overflow_model("mixed_float16", on_min_scale="ignore")
    monitor = AMPMonitor(log_dir, adapt=False)
    with pytest.raises(KeyboardInterrupt):
        ctrl_c = Interrupt(epoch=1, batch=3, error=KeyboardInterrupt)
        train(model, [monitor, ctrl_c], epochs=2)
    assert "train_step" in model.__dict__  # nothing ran since
    with caplog.at_level("WARNING", logger="keras_amp_plus"):
        train(model, [], epochs=1)
    assert any("stopped on an exception raised outside" in m for m in caplog.messages)
    assert not {"train_step", "compute_loss", "make_train_function"} & set(
        model.__dict__
    )
    # The events of the steps since the last read (every 64 steps) are written.
    events = [r for r in read_jsonl(log_dir) if r["type"] == "overflow"]
    assert [r["step"] for r in events] == list(range(1, STEPS_PER_EPOCH + 5))
    # The monitor's next `fit` replaces the stopped epoch's lines, as after a
    # step's exception.
    train(model, [monitor], epochs=1)
    events = [r for r in read_jsonl(log_dir) if r["type"] == "overflow"]
    assert [r["step"] for r in events] == list(range(1, 2 * STEPS_PER_EPOCH + 1))
    assert [r["epoch"] for r in events] == [0] * STEPS_PER_EPOCH + [1] * STEPS_PER_EPOCH


@pytest.mark.onednn
def test_a_rewrite_left_on_by_a_stopped_fit_is_off_after_another_models_fit():
    from keras_amp_plus.engines._grappler import GRAPPLER_OPTION

    def options():
        return tf.config.optimizer.get_experimental_options().get(GRAPPLER_OPTION)

    before = options()
    first = overflow_model("float32", scaler=None)
    with pytest.raises(KeyboardInterrupt):
        train(
            first,
            [AMPMonitor(None, engine="grappler"), Interrupt(0, 1, KeyboardInterrupt)],
            epochs=1,
        )
    assert options() is True
    second = overflow_model("float32", scaler=None)
    train(second, [AMPMonitor(None, engine="grappler")], epochs=1)
    assert options() == before
    assert "train_step" not in first.__dict__


def test_a_fit_run_from_a_callback_leaves_the_running_fit_alone(tmp_path, caplog):
    # Another model trained with its own monitor at each epoch's end: the
    # outer `fit` is still running and keeps its monitor.
    inner = overflow_model("float32", scaler=None)

    class TrainAnother(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            train(inner, [AMPMonitor(None)], epochs=1)

    outer = overflow_model("mixed_float16", on_min_scale="ignore")
    monitor = AMPMonitor(str(tmp_path), adapt=False)
    with caplog.at_level("WARNING", logger="keras_amp_plus"):
        train(outer, [monitor, TrainAnother()], epochs=2)
    assert not any("stopped on an exception" in m for m in caplog.messages)
    assert monitor.state.epoch == 1
    events = [r for r in read_jsonl(str(tmp_path)) if r["type"] == "overflow"]
    assert len(events) == 2 * STEPS_PER_EPOCH


def test_train_on_batch_from_a_callback_leaves_the_running_fit_alone(tmp_path, caplog):
    # It builds the train function as a new `fit` does, from inside this one.
    model = overflow_model("mixed_float16", on_min_scale="ignore")
    x, y = regression_data()

    class TrainOnBatch(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            self.model.train_on_batch(x[:BATCH], y[:BATCH])

    monitor = AMPMonitor(str(tmp_path), adapt=False)
    with caplog.at_level("WARNING", logger="keras_amp_plus"):
        history = train(model, [monitor, TrainOnBatch()], epochs=2)
    assert not any("stopped on an exception" in m for m in caplog.messages)
    # The step `train_on_batch` ran after the first epoch's end is recorded
    # in the second epoch.
    assert history.history["overflow_events"] == [STEPS_PER_EPOCH, STEPS_PER_EPOCH + 1]


def test_two_monitors_in_one_fit_fail_before_the_first_step(tmp_path):
    model = overflow_model("mixed_float16")
    kernel = model.get_layer("d1").kernel.numpy()
    monitors = [AMPMonitor(str(tmp_path / "a")), AMPMonitor(str(tmp_path / "b"))]
    with pytest.raises(ValueError, match="monitored by an AMPMonitor already") as info:
        train(model, monitors, epochs=1)
    assert "Received: model=" in str(info.value)
    np.testing.assert_array_equal(model.get_layer("d1").kernel.numpy(), kernel)
    # The first monitor's `fit` stopped before its first step; the model
    # trains again, with one monitor.
    train(model, [AMPMonitor(str(tmp_path / "c"))], epochs=1)
    assert "train_step" not in model.__dict__


def test_a_model_whose_fit_stopped_outside_its_steps_can_be_collected(tmp_path):
    import gc
    import weakref

    model = overflow_model("mixed_float16", on_min_scale="ignore")
    with pytest.raises(KeyboardInterrupt):
        ctrl_c = Interrupt(0, 1, KeyboardInterrupt)
        train(model, [AMPMonitor(str(tmp_path)), ctrl_c], epochs=1)
    alive = weakref.ref(model)
    del model, ctrl_c  # the callback holds the model too
    gc.collect()
    assert alive() is None

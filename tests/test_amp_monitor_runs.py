"""AMPMonitor across epochs, runs and reloads; its arguments; MirroredStrategy.

Uses the `overflow_model` of `test_amp_monitor` (layer `hot` overflows float16)
with a batch that overflows only sometimes: `hot` has a moderate fixed kernel,
fine on normal inputs, and one batch per epoch holds inputs 1e4 times larger.
"""

import logging
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
    text_values,
    train,
)

from keras_amp_plus import PrecisionLists, precision_report
from keras_amp_plus.callbacks import AMPMonitor
from keras_amp_plus.callbacks._adaptation import AdaptationRule
from keras_amp_plus.optimizers import LossScaleOptimizer


def sporadic_data():
    """Regression data whose second batch overflows `hot` in float16."""
    x, y = regression_data()
    x[BATCH : 2 * BATCH] *= 1e4
    return x, y


def fit_sporadic(monitor, epochs):
    model = overflow_model("mixed_float16", hot_scale=10.0)
    x, y = sporadic_data()
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=[monitor],
    )
    return model, history


def test_rule_accumulates_sporadic_evidence_with_decay():
    rule = AdaptationRule()  # deny_threshold=2, evidence_decay=0.7
    decisions = [rule.decide(epoch, {"a": 1}, set()) for epoch in range(3)]
    assert [[(d.layer, d.to) for d in ds] for ds in decisions] == [
        [],
        [],
        [("a", "deny")],
    ]
    lone = AdaptationRule()
    assert lone.decide(0, {"b": 1}, set()) == []
    assert all(lone.decide(epoch, {}, set()) == [] for epoch in range(1, 30))
    per_epoch = AdaptationRule(evidence_decay=0.0)
    assert all(per_epoch.decide(e, {"a": 1}, set()) == [] for e in range(5))


def test_one_overflow_per_epoch_is_denied_at_the_third_and_loss_stays_finite(
    tmp_path,
):
    monitor = AMPMonitor(str(tmp_path), read_every_steps=2)
    model, history = fit_sporadic(monitor, epochs=4)
    records = read_jsonl(str(tmp_path))
    forward = [r for r in records if r["type"] == "overflow" and r["trusted"]]
    assert [(r["epoch"], r["layers"]) for r in forward] == [
        (epoch, ["hot"]) for epoch in range(3)
    ]
    changes = [r for r in records if r["type"] == "list_change"]
    assert [(c["epoch"], c["name"], c["to"]) for c in changes] == [(2, "hot", "deny")]
    assert monitor.lists.deny_layers == ("hot",)
    assert model.get_layer("hot").compute_dtype == "float32"
    # The skipped step's Inf loss is left out of the epoch's mean.
    assert np.all(np.isfinite(history.history["loss"]))


def test_skipped_steps_loss_can_be_kept_in_the_epoch_mean():
    monitor = AMPMonitor(adapt=False, exclude_skipped_steps=False)
    _, history = fit_sporadic(monitor, epochs=1)
    assert history.history["overflow_events"][0] >= 1
    assert not np.isfinite(history.history["loss"][0])


class LossSpy(keras.callbacks.Callback):
    """Keeps the logs each epoch's end hands to a callback."""

    def __init__(self):
        super().__init__()
        self.epoch_logs = []

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_logs.append(dict(logs))


class Unmeasured(keras.metrics.Mean):
    """A metric whose direction Keras does not know."""

    def update_state(self, y_true, y_pred, sample_weight=None):
        return super().update_state(y_pred)


def test_an_epoch_of_skipped_steps_reads_its_worst_in_callbacks_before_the_monitor(
    tmp_path,
):
    # `hot` overflows float16 on every step until the monitor denies it after
    # the first epoch: no step of that epoch is applied.
    model = overflow_model("mixed_float16")
    metrics = ["mae", keras.metrics.R2Score(name="r2"), Unmeasured(name="mean")]
    model.compile(model.optimizer, loss="mse", metrics=metrics)
    spy = LossSpy()
    monitor = AMPMonitor(str(tmp_path))
    history = train(model, [spy, monitor, LossSpy()], epochs=2)
    first, second = spy.epoch_logs
    assert history.history["overflow_events"][0] == STEPS_PER_EPOCH
    # Keras reports the metrics' empty state as 0 (a "best" loss for
    # `ModelCheckpoint`); nothing was measured: each reads its worst value.
    assert first["loss"] == np.inf and first["mae"] == np.inf
    assert first["r2"] == -np.inf  # improves upwards
    assert np.isnan(first["mean"])  # which way is unknown
    assert all(np.isfinite(second[name]) for name in ("loss", "mae", "r2", "mean"))
    assert history.history["loss"][0] == np.inf
    # The next epoch reads Keras's own results again.
    assert history.history["loss"][1] == pytest.approx(second["loss"])


class BatchLossSpy(keras.callbacks.Callback):
    """Keeps each epoch's batch-end losses."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def on_epoch_begin(self, epoch, logs=None):
        self.losses.append([])

    def on_train_batch_end(self, batch, logs=None):
        self.losses[-1].append(float(logs["loss"]))


def test_skipped_forward_overflows_do_not_stop_a_run_with_terminate_on_nan(tmp_path):
    # Every step of the first epoch overflows forward (a NaN loss): the batch
    # logs before any applied step must not carry it to `TerminateOnNaN`,
    # which would stop the run before the monitor denies `hot`.
    model = overflow_model("mixed_float16")
    spy = BatchLossSpy()
    callbacks = [AMPMonitor(str(tmp_path)), keras.callbacks.TerminateOnNaN(), spy]
    history = train(model, callbacks, epochs=2)
    assert history.history["overflow_events"][0] == STEPS_PER_EPOCH
    assert len(history.history["loss"]) == 2
    assert model.get_layer("hot").compute_dtype == "float32"
    first, second = spy.losses
    assert first == [0.0] * STEPS_PER_EPOCH  # Keras's empty metrics
    assert np.isfinite(second).all()


def test_batch_logs_of_the_scalers_first_skipped_steps_are_their_losses(tmp_path):
    # At a scale of 2**19 the gradients overflow float16 backward: the first
    # steps are skipped while the scaler backs off, with real, finite losses
    # (those of the initial weights), which their batch logs give.
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = keras.Model(inputs, keras.layers.Dense(1, name="head")(inputs))
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=2.0**19)
    model.compile(optimizer, "mse")
    kernel, bias = (np.float64(w) for w in model.get_layer("head").get_weights())
    x, y = regression_data()
    spy = BatchLossSpy()
    history = train(model, [AMPMonitor(str(tmp_path)), spy], epochs=1)
    skipped = int(history.history["overflow_events"][0])
    assert 0 < skipped < STEPS_PER_EPOCH
    for batch, logged in enumerate(spy.losses[0][:skipped]):
        rows = slice(batch * BATCH, (batch + 1) * BATCH)
        error = x[rows].astype("float64") @ kernel + bias - y[rows]
        assert logged == pytest.approx(np.mean(error**2), rel=1e-2)


def test_an_epoch_of_skipped_steps_is_never_the_best(tmp_path):
    # Keras 3 takes the first value its monitoring callbacks see for the
    # best, NaN included (no value beats NaN after it): the skipped first
    # epoch must not be it.
    model = overflow_model("mixed_float16")
    model.compile(model.optimizer, loss="mse", metrics=["mae"])
    checkpoint = keras.callbacks.ModelCheckpoint(
        str(tmp_path / "best.keras"), monitor="mae", save_best_only=True
    )
    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=1)
    monitor = AMPMonitor(str(tmp_path))
    history = train(model, [monitor, checkpoint, stop], epochs=4)
    losses = history.history["loss"]
    assert losses[0] == np.inf and all(np.isfinite(losses[1:]))
    assert stop.best == min(losses) and len(losses) >= 3
    assert checkpoint.best == min(history.history["mae"])


def test_a_nan_validation_is_never_the_best(tmp_path, caplog):
    # Validation runs before the monitor's epoch end, so after epoch 0's
    # overflows it evaluates `hot` still in float16: NaN, which Keras 3's
    # callbacks would keep for the best (restoring the untrained weights),
    # wherever they are listed.
    model = overflow_model("mixed_float16")
    initial = model.get_weights()
    stop = keras.callbacks.EarlyStopping(
        monitor="val_loss", patience=2, restore_best_weights=True
    )
    checkpoint = keras.callbacks.ModelCheckpoint(
        str(tmp_path / "best.keras"), monitor="val_loss", save_best_only=True
    )
    x, y = regression_data()
    with caplog.at_level(logging.WARNING, logger="keras_amp_plus"):
        history = train(
            model,
            [stop, AMPMonitor(str(tmp_path), patience=10), checkpoint],
            epochs=4,
            validation_data=(x[:32], y[:32]),
        )
    val_losses = history.history["val_loss"]
    assert val_losses[0] == np.inf and all(np.isfinite(val_losses[1:]))
    assert len(val_losses) == 4
    assert stop.best == checkpoint.best == min(val_losses)
    assert any(
        not np.array_equal(a, b)
        for a, b in zip(initial, model.get_weights(), strict=True)
    )
    [record] = [r for r in read_jsonl(str(tmp_path)) if r["type"] == "nan_validation"]
    assert record["epoch"] == 0 and record["metrics"] == ["val_loss"]
    assert record["overflow_events"] == STEPS_PER_EPOCH
    assert "validation gave NaN, and these results read their worst values: " in (
        caplog.text
    )
    assert "worst values: val_loss (" in caplog.text
    # After fit, Keras's own NaN results come back.
    assert np.isfinite(model.evaluate(x[:32], y[:32], verbose=0))


def test_an_accuracy_measured_on_nan_outputs_is_never_the_best(tmp_path):
    # Epoch 0's validation runs on NaN outputs: its loss is NaN, and its
    # accuracy (argmax of NaN picks class 0, 90% of the labels) is a number
    # that no trained epoch reaches: it must not be kept for the best.
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 8)).astype("float32")
    y = (rng.random(256) < 0.1).astype("int32")
    inputs = keras.Input((8,))
    big = keras.initializers.Constant(1e5)  # its outputs overflow float16
    hidden = keras.layers.Dense(16, name="hot", kernel_initializer=big)(inputs)
    hidden = keras.layers.Dense(16, activation="relu")(hidden)
    outputs = keras.layers.Dense(2, activation="softmax", dtype="float32")(hidden)
    model = keras.Model(inputs, outputs)
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(1e-3))

    def share_of_zeros(y_true, y_pred):  # a metric of unknown direction
        return keras.ops.mean(keras.ops.equal(y_true, 0.0))

    model.compile(
        optimizer,
        "sparse_categorical_crossentropy",
        metrics=["accuracy", share_of_zeros],
    )
    checkpoint = keras.callbacks.ModelCheckpoint(
        str(tmp_path / "best.keras"), monitor="val_accuracy", save_best_only=True
    )
    history = model.fit(
        x,
        y,
        epochs=4,
        batch_size=32,
        validation_data=(x[:64], y[:64]),
        verbose=0,
        callbacks=[AMPMonitor(str(tmp_path)), checkpoint],
    )
    losses, accuracies = history.history["val_loss"], history.history["val_accuracy"]
    nan_epochs = [epoch for epoch, loss in enumerate(losses) if loss == np.inf]
    assert nan_epochs[0] == 0 and len(nan_epochs) < len(losses)
    for epoch, accuracy in enumerate(accuracies):
        assert (accuracy == -np.inf) == (epoch in nan_epochs)
    assert checkpoint.best == max(a for a in accuracies if np.isfinite(a))
    # Keras 3's callbacks take a first NaN for the best: it keeps its value.
    assert np.isfinite(history.history["val_share_of_zeros"]).all()
    records = [r for r in read_jsonl(str(tmp_path)) if r["type"] == "nan_validation"]
    assert [r["epoch"] for r in records] == nan_epochs
    assert records[0]["metrics"] == ["val_accuracy", "val_loss"]


class StopAfterEpoch(keras.callbacks.Callback):
    """Stop `fit` at the end of epoch `last` (as `EarlyStopping` may)."""

    def __init__(self, last):
        super().__init__()
        self.last = last

    def on_epoch_end(self, epoch, logs=None):
        if epoch == self.last:
            self.model.stop_training = True


class CalmDown(keras.callbacks.Callback):
    """Scale `hot`'s kernel down after epoch 0: its overflows were transient."""

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            kernel = self.model.get_layer("hot").kernel
            kernel.assign(kernel * 1e-4)


@pytest.mark.parametrize("stopper", ("last epoch", "before", "after"))
def test_no_layer_is_left_moved_back_without_a_trial(tmp_path, stopper):
    # At patience 1, `hot` (denied after epoch 0) earns low precision back at
    # epoch 1's end; it moves at the first step of the next epoch. If no epoch
    # follows (the last one, or a callback before or after the monitor
    # stopped the fit), the model keeps it in float32; the next fit's first
    # step moves it.
    model = overflow_model("mixed_float16")
    monitor = AMPMonitor(str(tmp_path), patience=1, cooldown=0)
    callbacks = {
        "last epoch": [monitor, CalmDown()],
        "before": [StopAfterEpoch(1), monitor, CalmDown()],
        "after": [monitor, CalmDown(), StopAfterEpoch(1)],
    }[stopper]
    train(model, callbacks, epochs=2 if stopper == "last epoch" else 5)
    assert model.get_layer("hot").compute_dtype == "float32"
    assert monitor.lists.deny_layers == ("hot",)
    assert [e["layer"] for e in monitor.state.adaptation["pending_returns"]] == ["hot"]
    changes = [r for r in read_jsonl(str(tmp_path)) if r["type"] == "list_change"]
    assert [(c["epoch"], c["from"], c["to"]) for c in changes] == [(0, None, "deny")]
    train(model, [monitor], epochs=2)
    changes = [r for r in read_jsonl(str(tmp_path)) if r["type"] == "list_change"]
    # Named by the epoch whose end decided it, as a denial is.
    assert [(c["epoch"], c["to"]) for c in changes][-1] == (1, "allow")
    assert model.get_layer("hot").compute_dtype == "float16"
    assert monitor.state.adaptation["pending_returns"] == []


def test_a_loop_of_one_epoch_fits_tries_a_denied_layer_again(tmp_path):
    # Every epoch of a one-epoch fit is its last: the move back decided at
    # the end of one happens at the next fit's first step.
    model = overflow_model("mixed_float16")
    monitor = AMPMonitor(str(tmp_path), patience=1, cooldown=0)
    dtypes = []
    for _ in range(3):
        train(model, [monitor, CalmDown()], epochs=1)
        dtypes.append(model.get_layer("hot").compute_dtype)
    assert dtypes == ["float32", "float32", "float16"]
    changes = [r for r in read_jsonl(str(tmp_path)) if r["type"] == "list_change"]
    moves = [(c["epoch"], c["from"], c["to"]) for c in changes]
    assert moves == [(0, None, "deny"), (1, "deny", "allow")]
    assert "clean epochs in float32" in changes[-1]["reason"]


def test_a_checkpoint_saved_when_a_layer_earns_its_way_back_continues_the_lists(
    tmp_path,
):
    # The move back waits for the next epoch's first step, so a checkpoint
    # saved at the epoch end that decided it (a callback after the monitor)
    # holds `hot` in float32, as the state file records: a new monitor on
    # the reloaded model continues the lists and moves `hot` back.
    log_dir, checkpoint = str(tmp_path / "logs"), str(tmp_path / "model.keras")
    model = overflow_model("mixed_float16")
    monitor = AMPMonitor(log_dir, patience=1, cooldown=0)
    saver = keras.callbacks.ModelCheckpoint(checkpoint)
    train(model, [monitor, CalmDown(), saver, StopAfterEpoch(1)], epochs=5)
    reloaded = keras.saving.load_model(checkpoint)
    assert reloaded.get_layer("hot").compute_dtype == "float32"
    again = AMPMonitor(log_dir, patience=1, cooldown=0)
    train(reloaded, [again], epochs=1)
    assert reloaded.get_layer("hot").compute_dtype == "float16"
    assert again.lists.allow_layers == ("hot",) and again.lists.deny_layers == ()
    [back] = [
        r
        for r in read_jsonl(log_dir)
        if r["type"] == "list_change" and r["to"] == "allow"
    ]
    # The new run's first epoch moved it; run 1 decided it at its epoch 1.
    assert (back["run"], back["epoch"]) == (2, 0)
    assert "decided by run 1 at its epoch 1" in back["reason"]


def test_a_new_run_stopped_after_its_first_step_moved_a_layer_back(tmp_path):
    # The state file saved for a run stopped in its first epoch holds the
    # lists of the last epoch end, the move still pending, as the model
    # does: the next monitor continues them and moves the layer back.
    model = overflow_model("mixed_float16")
    train(model, [AMPMonitor(str(tmp_path), patience=1, cooldown=0), CalmDown()], 2)
    second = AMPMonitor(str(tmp_path), patience=1, cooldown=0)
    with pytest.raises(Exception, match="the input pipeline broke"):
        model.fit(
            breaking_data(), epochs=1, shuffle=False, verbose=0, callbacks=[second]
        )
    assert model.get_layer("hot").compute_dtype == "float32"
    changes = [r for r in read_jsonl(str(tmp_path)) if r["type"] == "list_change"]
    assert [(c["run"], c["from"], c["to"]) for c in changes] == [
        (1, None, "deny"),
        (2, "deny", "allow"),
        (2, "allow", "deny"),
    ]
    assert "the fit stopped in the epoch that tried it" in changes[-1]["reason"]
    third = AMPMonitor(str(tmp_path), patience=1, cooldown=0)
    train(model, [third], epochs=1)
    assert model.get_layer("hot").compute_dtype == "float16"
    assert third.lists.allow_layers == ("hot",)


def test_a_monitor_that_does_not_adapt_keeps_the_pending_move_back(tmp_path):
    model = overflow_model("mixed_float16")
    monitor = AMPMonitor(str(tmp_path), patience=1, cooldown=0)
    train(model, [monitor, CalmDown()], epochs=2)
    monitor.adapt = False
    train(model, [monitor], epochs=1)
    assert model.get_layer("hot").compute_dtype == "float32"
    assert monitor.lists.deny_layers == ("hot",)
    monitor.adapt = True
    train(model, [monitor], epochs=1)
    assert model.get_layer("hot").compute_dtype == "float16"
    changes = [r for r in read_jsonl(str(tmp_path)) if r["type"] == "list_change"]
    # Named by the epoch that decided it, not the one that carried it out.
    assert [(c["epoch"], c["to"]) for c in changes] == [(0, "deny"), (1, "allow")]


def breaking_data():
    """A dataset whose second batch raises (an input pipeline that broke)."""
    x, y = regression_data()

    def batches():
        yield x[:BATCH], y[:BATCH]
        raise RuntimeError("the input pipeline broke")

    return tf.data.Dataset.from_generator(
        batches,
        output_signature=(
            tf.TensorSpec((None, 4), tf.float32),
            tf.TensorSpec((None, 1), tf.float32),
        ),
    )


def test_a_fit_stopped_after_a_move_back_leaves_the_model_as_the_record(tmp_path):
    # The move back happens at the first step; a step that raises ends the
    # fit, and the record goes back to the last epoch end: so does the model.
    model = overflow_model("mixed_float16")
    monitor = AMPMonitor(str(tmp_path), patience=1, cooldown=0)
    train(model, [monitor, CalmDown()], epochs=2)
    with pytest.raises(Exception, match="the input pipeline broke"):
        model.fit(
            breaking_data(), epochs=1, shuffle=False, verbose=0, callbacks=[monitor]
        )
    assert model.get_layer("hot").compute_dtype == "float32"
    assert monitor.lists.deny_layers == ("hot",)
    assert [e["layer"] for e in monitor.state.adaptation["pending_returns"]] == ["hot"]


def test_each_epoch_boundary_writes_one_change_and_one_lists_record(tmp_path):
    # TensorBoard keeps one value per step of a tag (a later one at a step
    # replaces it): the move back's change is written at the epoch that
    # decided it, with the lists of the next epoch, the move included.
    model = overflow_model("mixed_float16")
    monitor = AMPMonitor(str(tmp_path), patience=1, cooldown=0)
    train(model, [monitor, CalmDown(), StopAfterEpoch(1)], epochs=5)
    train(model, [monitor], epochs=1)
    accumulator = read_tensorboard(str(tmp_path))
    for tag in ("amp/changes", "amp/lists"):
        steps = [event.step for event in accumulator.Tensors(tag)]
        assert len(steps) == len(set(steps)), (tag, steps)
    changes = dict(
        zip(
            [e.step for e in accumulator.Tensors("amp/changes")],
            text_values(accumulator, "amp/changes"),
            strict=True,
        )
    )
    assert "| layer | hot | None | deny |" in changes[0]
    assert "| layer | hot | deny | allow |" in changes[1]
    assert "from the next epoch's first step" in changes[1]
    lists = dict(
        zip(
            [e.step for e in accumulator.Tensors("amp/lists")],
            text_values(accumulator, "amp/lists"),
            strict=True,
        )
    )
    assert sorted(lists) == [0, 1, 2]
    assert "| deny_layers | `hot` |" in lists[1]
    assert "| allow_layers | `hot` |" in lists[2]


def test_early_stopping_on_loss_keeps_a_run_with_sporadic_overflows():
    monitor = AMPMonitor(adapt=False, evidence_decay=0.0)
    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=1)
    model = overflow_model("mixed_float16", hot_scale=10.0)
    x, y = sporadic_data()
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=4,
        shuffle=False,
        verbose=0,
        callbacks=[monitor, stop],
    )
    assert len(history.history["loss"]) == 4


def nested_overflow_model():
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    backbone = keras.Sequential(
        [
            keras.layers.Dense(8, name="d1"),
            keras.layers.Dense(
                16,
                name="hot",
                trainable=False,
                kernel_initializer=keras.initializers.RandomNormal(stddev=3e4, seed=1),
            ),
        ],
        name="backbone",
    )
    inputs = keras.Input((4,))
    h = keras.layers.LayerNormalization(name="ln")(backbone(inputs))
    outputs = keras.layers.Dense(1, name="head")(h)
    model = keras.Model(inputs, outputs)
    model.compile(LossScaleOptimizer(keras.optimizers.Adam(0.1)), loss="mse")
    return model


def test_a_reloaded_nested_model_keeps_the_names_the_monitor_wrote(tmp_path):
    log_dir = str(tmp_path / "logs")
    model = nested_overflow_model()
    monitor = AMPMonitor(log_dir, read_every_steps=4, patience=50)
    train(model, [monitor], epochs=2)
    assert monitor.lists.deny_layers == ("backbone/hot",)
    path = str(tmp_path / "model.keras")
    model.save(path)

    loaded = keras.saving.load_model(path)
    assert loaded.get_layer("backbone").get_layer("hot").compute_dtype == "float32"
    # The same monitor (its lists and state file) goes on with the reloaded model.
    monitor.set_model(loaded)
    train(loaded, [monitor], epochs=1)
    again = AMPMonitor(str(tmp_path / "other"), lists=monitor.lists)
    train(loaded, [again], epochs=1)
    hot = loaded.get_layer("backbone").get_layer("hot")
    assert hot.compute_dtype == "float32"
    events = [r for r in read_jsonl(log_dir) if r["type"] == "overflow"]
    assert {tuple(e["layers"]) for e in events if e["trusted"]} == {("backbone/hot",)}


def test_backward_blame_uses_the_order_the_step_ran_the_layers():
    from keras_amp_plus.callbacks._attribution import LayerIndex
    from keras_amp_plus.callbacks._step_recorder import StepRecorder

    keras.utils.set_random_seed(0)
    backbone = keras.Sequential(
        [keras.layers.Dense(4, name=f"bb{i}") for i in (1, 2, 3)], name="backbone"
    )
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(1, name="head")(backbone(inputs))
    model = keras.Model(inputs, outputs)
    model.compile("sgd", "mse")
    recorder = StepRecorder(model, 4)
    recorder.install()
    model.make_train_function(force=True)
    model.fit(np.ones((4, 4)), np.ones((4, 1)), verbose=0)
    recorder.uninstall()
    index = LayerIndex(model)
    index.set_call_order(recorder.call_order)
    kernels = [
        layer.kernel.path for layer in backbone.layers
    ]  # bb1, bb2, bb3: all implicated, bb3 is closest to the loss
    implicated = index.layers_of_variables(kernels)
    assert implicated == ["backbone/bb1", "backbone/bb2", "backbone/bb3"]
    assert index.backward_origin(implicated) == "backbone/bb3"


def test_a_second_run_appends_and_continues_the_tensorboard_steps(tmp_path):
    log_dir = str(tmp_path)
    train(overflow_model("mixed_float16"), [AMPMonitor(log_dir)], epochs=2)
    first = read_jsonl(log_dir)
    first_steps = scalar_series(read_tensorboard(log_dir), "amp/skipped_steps")
    monitor = AMPMonitor(log_dir)
    model = overflow_model("mixed_float16")
    train(model, [monitor], epochs=2)
    records = read_jsonl(log_dir)
    assert records[: len(first)] == first  # never rewritten
    assert {r["run"] for r in first} == {1}
    assert {r["run"] for r in records[len(first) :]} == {2}
    # The same monitor in another fit continues too.
    train(model, [monitor], epochs=1)
    accumulator = read_tensorboard(log_dir)
    per_epoch = scalar_series(accumulator, "amp/overflow_events")
    assert sorted(per_epoch) == [0, 1, 2, 3, 4]
    steps = scalar_series(accumulator, "amp/skipped_steps")
    assert max(steps) == 5 * STEPS_PER_EPOCH
    assert max(first_steps) == 2 * STEPS_PER_EPOCH


def test_a_monitor_reused_for_another_model_starts_from_its_own_lists(tmp_path):
    # A callbacks list reused for the next experiment: the first model's
    # denial of `hot` is not applied to another model's layer of that name.
    log_dir = str(tmp_path)
    monitor = AMPMonitor(log_dir, lists={"deny_layers": ["head"]}, read_every_steps=4)
    train(overflow_model("mixed_float16"), [monitor], epochs=2)
    assert monitor.lists.deny_layers == ("head", "hot")
    calm = overflow_model("mixed_float16", hot_scale=0.1)
    train(calm, [monitor], epochs=1)
    assert calm.get_layer("hot").compute_dtype == "float16"
    assert calm.get_layer("head").compute_dtype == "float32"
    assert monitor.lists.deny_layers == ("head",)
    assert monitor.state.run == 2


@pytest.mark.onednn
def test_engine_auto_is_resolved_again_at_every_fit(tmp_path):
    # "auto" chose the layer engine for empty lists; op lists given later
    # need a graph engine, which a fresh monitor would choose too.
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1, name="d")])
    model.compile("sgd", "mse")
    monitor = AMPMonitor(str(tmp_path), adapt=False)
    train(model, [monitor], epochs=1)
    assert monitor.engine.name == "keras"
    assert monitor.get_config()["engine"] == "auto"
    monitor.lists = PrecisionLists(deny_ops=("MatMul",))
    seen = []
    watch = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: seen.append(
            os.environ.get("TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_DENYLIST_ADD")
        )
    )
    train(model, [monitor, watch], epochs=1)
    assert monitor.engine.name == "grappler"
    assert seen and set(seen) == {"MatMul"}  # in force while the model trained
    engine = monitor.engine
    train(model, [monitor], epochs=1)
    assert monitor.engine is engine  # the same kind again: its rebuilt step kept


def test_the_loss_scale_series_goes_forward_in_steps(tmp_path):
    # `hot` is denied after the first epoch and the scale put back; the
    # scaler then backs off again in the second.
    train(overflow_model("mixed_float16"), [AMPMonitor(str(tmp_path))], epochs=3)
    points = [
        (event.step, float(tf.make_ndarray(event.tensor_proto)))
        for event in read_tensorboard(str(tmp_path)).Tensors("amp/loss_scale")
    ]
    steps = [step for step, _ in points]
    assert steps == sorted(steps)
    assert len(set(points)) == len(points)
    restored = [r for r in read_jsonl(str(tmp_path)) if r["type"] == "scale_restored"]
    # The put-back scale is on the chart.
    assert restored and restored[0]["to"] in [value for _, value in points]


@pytest.mark.parametrize("reload", [False, True])
def test_a_new_monitor_continues_the_lists_the_model_still_carries(tmp_path, reload):
    log_dir = str(tmp_path / "logs")
    model = overflow_model("mixed_float16")
    first = AMPMonitor(log_dir)
    train(model, [first], epochs=2)
    assert first.lists.deny_layers == ("hot",)
    skipped = max(
        scalar_series(read_tensorboard(log_dir), "amp/skipped_steps").values()
    )
    if reload:
        path = str(tmp_path / "model.keras")
        model.save(path)
        model = keras.saving.load_model(path)
    assert model.get_layer("hot").compute_dtype == "float32"
    second = AMPMonitor(log_dir)
    train(model, [second], epochs=1)
    # Not the empty lists while `hot` runs in float32; and its memory, so
    # `hot` can still move back after `patience` clean epochs.
    assert second.lists.deny_layers == ("hot",)
    assert "hot" in second.rule.get_state()["denials"]
    lists_texts = [r for r in read_jsonl(log_dir) if r["type"] == "list_change"]
    assert [(r["run"], r["name"]) for r in lists_texts] == [(1, "hot")]
    # One cumulative series: the second run starts where the first stopped.
    steps = scalar_series(read_tensorboard(log_dir), "amp/skipped_steps")
    later = [value for step, value in steps.items() if step > 2 * STEPS_PER_EPOCH]
    assert later and min(later) >= skipped
    # Another experiment's fresh model into the same log_dir starts afresh.
    third = AMPMonitor(log_dir)
    train(overflow_model("mixed_float16", hot_scale=1.0), [third], epochs=1)
    assert third.lists.deny_layers == ()


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"adapt": "no"}, TypeError),
        ({"replay": "false"}, TypeError),
        ({"exclude_skipped_steps": 1}, TypeError),
        ({"engine": "xla"}, ValueError),
        ({"engine": 42}, ValueError),
        ({"log_dir": ""}, ValueError),
        ({"trusted_backward_scale": -5}, ValueError),
        ({"trusted_backward_scale": float("nan")}, ValueError),
        ({"trusted_backward_scale": True}, ValueError),
        ({"evidence_decay": 1.0}, ValueError),
        ({"patience": True}, ValueError),
    ],
)
def test_every_argument_is_checked_at_construction(kwargs, error):
    (name,) = kwargs
    with pytest.raises(error, match=f"Received: {name}="):
        AMPMonitor(**kwargs)


class CountingModel(keras.Model):
    """Counts how often its train step is traced (a Python side effect)."""

    traces = 0

    def train_step(self, data):
        CountingModel.traces += 1
        return super().train_step(data)


def test_repeated_fits_reuse_the_traced_step():
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = CountingModel(inputs, keras.layers.Dense(1, name="head")(inputs))
    model.compile("sgd", "mse")
    monitor = AMPMonitor()
    x, y = np.ones((32, 4)), np.ones((32, 1))
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[monitor])
    after_first = CountingModel.traces
    for _ in range(3):
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[monitor])
    assert after_first >= 1
    assert CountingModel.traces == after_first
    # Recompiling makes a new train function: traced again, still recorded.
    model.compile("sgd", "mse")
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[monitor])
    assert CountingModel.traces > after_first


def test_repeated_fits_with_lists_reuse_the_traced_step():
    # Each `fit` starts by applying the monitor's lists; applied again
    # unchanged, they must not force a new trace (seconds on a large model).
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, name="hidden", dtype="mixed_bfloat16")(inputs)
    model = CountingModel(inputs, keras.layers.Dense(1, name="head")(hidden))
    model.compile("sgd", "mse")
    lists = PrecisionLists(deny_layers=["hidden"])
    monitor = AMPMonitor(lists=lists, engine="keras")
    x, y = np.ones((32, 4)), np.ones((32, 1))
    CountingModel.traces = 0
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[monitor])
    assert model.get_layer("hidden").dtype_policy.name == "float32"
    after_first = CountingModel.traces
    for _ in range(2):
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[monitor])
    assert after_first >= 1
    assert CountingModel.traces == after_first


@pytest.mark.onednn  # the grappler engine (see conftest.py)
def test_repeated_fits_with_the_graph_engine_reuse_the_traced_step(tmp_path):
    # The graph engine puts the rewrite's global switches back after each
    # `fit` and sets them again at the next: the step optimized under them
    # is reused, and its graph dumps still count the converted nodes.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(8, name="hidden")(inputs)
    model = CountingModel(inputs, keras.layers.Dense(1, name="head")(hidden))
    model.compile("sgd", "mse")
    monitor = AMPMonitor(str(tmp_path), engine="grappler")
    x, y = np.ones((32, 4)), np.ones((32, 1))
    options = tf.config.optimizer.get_experimental_options()
    CountingModel.traces = 0
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[monitor])
    after_first = CountingModel.traces
    for _ in range(2):
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[monitor])
        assert tf.config.optimizer.get_experimental_options() == options
    assert after_first >= 1
    assert CountingModel.traces == after_first
    converted = precision_report(model)["graph"]["train"]["converted_by_op"]
    assert converted["MatMul"] > 0


def test_a_log_dir_on_another_file_system_holds_every_file(tmp_path, monkeypatch):
    # `ram://` is TensorFlow's in-memory file system, a stand-in for
    # `gs://`: every file goes through `tf.io.gfile`, nothing to local disk.
    monkeypatch.chdir(tmp_path)
    log_dir = f"ram://{tmp_path.name}/logs"
    history = fit_sporadic(AMPMonitor(log_dir), epochs=2)[1]
    events = history.history["overflow_events"]
    assert sum(events) >= 2
    with tf.io.gfile.GFile(f"{log_dir}/amp_events.jsonl") as f:
        lines = [line for line in f if '"type": "overflow"' in line]
    assert len(lines) == sum(events)
    assert tf.io.gfile.exists(f"{log_dir}/amp_state.json")
    assert tf.io.gfile.glob(f"{log_dir}/amp/events.out.tfevents.*")
    assert list(tmp_path.iterdir()) == []
    # A second run in the same directory continues its record.
    fit_sporadic(AMPMonitor(log_dir), epochs=1)
    with tf.io.gfile.GFile(f"{log_dir}/amp_events.jsonl") as f:
        runs = {line.split('"run": ')[1].split(",")[0] for line in f}
    assert runs == {"1", "2"}


def test_a_run_continued_by_another_fit_writes_each_point_once(tmp_path):
    model = overflow_model("mixed_float16")
    monitor = AMPMonitor(str(tmp_path))
    train(model, [monitor], epochs=1)
    train(model, [monitor], epochs=2)
    accumulator = read_tensorboard(str(tmp_path))
    # A scale put back is two points at one step (before and after); no
    # point is written twice.
    for tag in ("amp/loss_scale", "amp/lists", "amp/skipped_steps"):
        points = [
            (event.step, tf.make_ndarray(event.tensor_proto).tobytes())
            for event in accumulator.Tensors(tag)
        ]
        assert len(points) == len(set(points)), tag
        assert [step for step, _ in points] == sorted(step for step, _ in points)
    # The second `fit` continues the run: its epochs are the run's 1 and 2.
    events = [r for r in read_jsonl(str(tmp_path)) if r["type"] == "overflow"]
    assert all(
        r["epoch"] == (r["step"] - 1) // STEPS_PER_EPOCH and r["run"] == 1
        for r in events
    )
    assert sorted(scalar_series(accumulator, "amp/overflow_events")) == [0, 1, 2]


def test_a_new_monitor_in_the_log_dir_writes_each_scale_point_once(tmp_path):
    # The second run starts where the first stopped, at the scale it left:
    # that point is on the chart already, and its first step overflows (the
    # scale before it is drawn at the step before, the first run's last).
    model = overflow_model("mixed_float16", hot_scale=10.0)
    x, y = regression_data()
    x[:BATCH] *= 1e4
    for _ in range(2):
        monitor = AMPMonitor(str(tmp_path), adapt=False)
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    points = [
        (event.step, float(tf.make_ndarray(event.tensor_proto)))
        for event in read_tensorboard(str(tmp_path)).Tensors("amp/loss_scale")
    ]
    assert {r["run"] for r in read_jsonl(str(tmp_path))} == {1, 2}
    assert len(points) > 2
    assert len(set(points)) == len(points), points


def test_messages_of_a_later_fit_number_epochs_as_its_records(tmp_path, caplog):
    # The same monitor's second fit is the run's epoch 1 in the records, in
    # TensorBoard and in the warnings alike.
    model = overflow_model("mixed_float16", hot_scale=10.0)
    x, y = sporadic_data()
    monitor = AMPMonitor(str(tmp_path), deny_threshold=100)
    fit = {"batch_size": BATCH, "shuffle": False, "verbose": 0, "callbacks": [monitor]}
    model.fit(x, y, **fit)
    monitor.rule.deny_threshold = 1
    with caplog.at_level(logging.WARNING, logger="keras_amp_plus"):
        model.fit(x, y, **fit)
    (change,) = [r for r in read_jsonl(str(tmp_path)) if r["type"] == "list_change"]
    assert change["epoch"] == 1
    moved = [m for m in caplog.messages if "moved from" in m]
    assert moved and all(m.startswith("AMPMonitor epoch 1:") for m in moved), moved
    put_back = [m for m in caplog.messages if "loss scale put back" in m]
    assert put_back and all(m.startswith("AMPMonitor epoch 1:") for m in put_back)


class _AmplifyingHot(keras.layers.Layer):
    """`x @ 20 * 1e-3`: overflows float16 forward, and `d1`'s gradients too.

    The product overflows for inputs of order 400; the large kernel scales
    the gradients reaching `d1` up.
    """

    def build(self, input_shape):
        self.kernel = self.add_weight(
            shape=(input_shape[-1], 32), initializer=keras.initializers.Constant(20.0)
        )

    def call(self, inputs):
        return keras.ops.matmul(inputs, self.kernel) * 1e-3


def test_the_scale_put_back_keeps_the_backoffs_for_backward_overflows(tmp_path):
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(1)
    inputs = keras.Input((16,))
    hidden = _AmplifyingHot(name="hot")(inputs)
    hidden = keras.layers.Dense(16, activation="relu", name="d1")(hidden)
    model = keras.Model(
        inputs, keras.layers.Dense(1, name="out", dtype="float32")(hidden)
    )
    model.compile(LossScaleOptimizer(keras.optimizers.Adam(1e-3)), "mse")
    rng = np.random.default_rng(0)
    x = (rng.normal(size=(64, 16)) * 400.0).astype("float32")
    y = rng.normal(size=(64, 1)).astype("float32")
    model.fit(
        x,
        y,
        batch_size=8,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[AMPMonitor(str(tmp_path))],
    )
    records = read_jsonl(str(tmp_path))
    overflows = [r for r in records if r["type"] == "overflow"]
    forward = [r for r in overflows if r["direction"] == "forward"]
    assert forward and {tuple(r["layers"]) for r in forward} == {("hot",)}
    since = [r for r in overflows if r["step"] > forward[0]["step"]]
    backward = [r for r in since if r["direction"] == "backward"]
    assert backward, "no backward overflow after the first forward one"
    # Not above any scale the scaler backed off to for a gradient's overflow.
    restored = [r for r in records if r["type"] == "scale_restored"]
    assert [r["to"] for r in restored] == [min(r["scale_after"] for r in backward)]
    assert restored[0]["to"] < forward[0]["scale_before"]

"""AMPMonitor end to end: a model with one layer that overflows float16 on purpose.

`hot` is a Dense with a large fixed (non-trainable) kernel: its outputs are
about 1e5, fine in float32 and Inf in float16 (max 65504). The LayerNormalization
after it (float32 statistics in Keras 3) brings them back to order 1, so once
`hot` runs in float32 the rest of the model trains in float16 without trouble.
"""

import logging
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import (
    STEPS_PER_EPOCH,
    overflow_model,
    read_jsonl,
    read_tensorboard,
    scalar_series,
    text_values,
    train,
)

from keras_amp_plus._lists.precision_lists import PrecisionLists
from keras_amp_plus.callbacks import AMPMonitor
from keras_amp_plus.optimizers import LossScaleOptimizer

EPOCHS = 10  # enough for float16 (first epoch skipped) to catch up with float32


def test_forward_overflow_is_attributed_and_denied(tmp_path):
    log_dir = str(tmp_path / "logs")
    model = overflow_model("mixed_float16")
    # patience=10: `hot` must not be tried in float16 again within this run.
    monitor = AMPMonitor(log_dir, read_every_steps=4, patience=10)
    csv_path = str(tmp_path / "log.csv")
    history = train(
        model, [monitor, keras.callbacks.CSVLogger(csv_path)], epochs=EPOCHS
    )

    # Every step of epoch 0 overflows (skipped); after it `hot` is denied and
    # the scale put back to 2**15, from where the scaler may search again
    # (backward overflows above trusted_backward_scale: not attributed).
    assert history.history["overflow_events"][0] == STEPS_PER_EPOCH
    records = read_jsonl(log_dir)
    later = [r for r in records if r["type"] == "overflow" and r["epoch"] > 0]
    assert not any(r["trusted"] for r in later)
    events = [r for r in records if r["type"] == "overflow" and r["epoch"] == 0]
    assert len(events) == STEPS_PER_EPOCH
    assert [e["step"] for e in events] == list(range(1, STEPS_PER_EPOCH + 1))
    assert all(e["layers"] == ["hot"] and e["direction"] == "forward" for e in events)
    assert all(e["epoch"] == 0 and e["kind"] in ("nan", "inf") for e in events)
    assert [e["scale_before"] for e in events] == [
        2.0 ** (15 - i) for i in range(STEPS_PER_EPOCH)
    ]
    assert all(e["scale_after"] == e["scale_before"] / 2 for e in events)
    changes = [r for r in read_jsonl(log_dir) if r["type"] == "list_change"]
    assert [(c["epoch"], c["name"], c["from"], c["to"]) for c in changes] == [
        (0, "hot", None, "deny")
    ]
    assert monitor.lists.deny_layers == ("hot",)
    policies = {layer.name: layer.compute_dtype for layer in model.layers[1:]}
    assert policies == {
        "d1": "float16",
        "hot": "float32",
        "ln": "float16",
        "head": "float16",
    }
    # logs reach History and CSVLogger (the monitor runs before them).
    with open(csv_path) as f:
        header = f.readline().strip().split(",")
    assert "loss_scale" in header and "overflow_events" in header
    restored = [r for r in records if r["type"] == "scale_restored"]
    assert [(r["from"], r["to"]) for r in restored] == [
        (2.0**15 / 2**STEPS_PER_EPOCH, 2.0**15)
    ]
    assert history.history["loss_scale"][0] == 2.0**15

    # Same model, float32 throughout: the final loss is within 5%.
    reference = train(overflow_model("float32", scaler="none"), [], epochs=EPOCHS)
    final, final32 = history.history["loss"][-1], reference.history["loss"][-1]
    assert abs(final - final32) / final32 < 0.05

    accumulator = read_tensorboard(log_dir)
    per_epoch = {epoch: 0.0 for epoch in range(EPOCHS)}
    per_epoch[0] = float(STEPS_PER_EPOCH)
    assert scalar_series(accumulator, "amp/overflow/hot") == per_epoch
    events_per_epoch = history.history["overflow_events"]
    assert scalar_series(accumulator, "amp/overflow_events") == dict(
        enumerate(map(float, events_per_epoch))
    )
    assert scalar_series(accumulator, "amp/overflow_rate")[0] == 1.0
    skipped = scalar_series(accumulator, "amp/skipped_steps")
    assert skipped[4] == 4.0 and max(skipped.values()) == sum(events_per_epoch)
    scales = scalar_series(accumulator, "amp/loss_scale")
    # A point at every scale change: each halving of epoch 0, the restore.
    assert [scales[step] for step in range(STEPS_PER_EPOCH)] == [
        2.0 ** (15 - step) for step in range(STEPS_PER_EPOCH)
    ]
    # Put back at the end of epoch 0 (its last step, 8): step 9 starts from it.
    assert scales[STEPS_PER_EPOCH] == 2.0**15
    assert "hot" in text_values(accumulator, "amp/lists")[-1]
    assert "| layer | hot | None | deny |" in text_values(accumulator, "amp/changes")[0]


def test_without_adaptation_overflows_go_on(tmp_path):
    # The scale reaches its floor after 15 overflows; its warning is not tested.
    model = overflow_model("mixed_float16", on_min_scale="ignore")
    monitor = AMPMonitor(str(tmp_path), adapt=False, read_every_steps=3)
    history = train(model, [monitor], epochs=3)
    assert history.history["overflow_events"] == [STEPS_PER_EPOCH] * 3
    assert monitor.lists.deny_layers == ()
    assert model.get_layer("hot").compute_dtype == "float16"
    events = [r for r in read_jsonl(str(tmp_path)) if r["type"] == "overflow"]
    assert len(events) == 3 * STEPS_PER_EPOCH
    assert {tuple(e["layers"]) for e in events} == {("hot",)}


def test_keras_scaler_events_from_scale_changes(tmp_path):
    model = overflow_model("mixed_float16", scaler="keras")
    assert type(model.optimizer) is keras.optimizers.LossScaleOptimizer
    monitor = AMPMonitor(str(tmp_path), read_every_steps=5)
    history = train(model, [monitor], epochs=2)
    assert history.history["overflow_events"][0] == STEPS_PER_EPOCH
    records = read_jsonl(str(tmp_path))
    events = [r for r in records if r["type"] == "overflow" and r["epoch"] == 0]
    # Exact count and scales from the in-graph ring, without our scaler.
    assert [e["scale_before"] for e in events] == [
        2.0 ** (15 - i) for i in range(STEPS_PER_EPOCH)
    ]
    assert all(e["layers"] == ["hot"] for e in events)
    assert all(e["implicated_layers"] == [] for e in events)
    assert model.get_layer("hot").compute_dtype == "float32"
    # Put back to its value before the forward overflows (Keras's scaler too).
    restored = [r for r in records if r["type"] == "scale_restored"]
    assert [(r["from"], r["to"]) for r in restored] == [(2.0**7, 2.0**15)]


@pytest.mark.parametrize("scaler", ["none", "guard"])
def test_bfloat16_non_finite_loss_is_watched(tmp_path, caplog, scaler):
    # bfloat16 has float32's range: make `hot` overflow float32 too.
    model = overflow_model("mixed_bfloat16", scaler=scaler, hot_scale=5e37)
    monitor = AMPMonitor(str(tmp_path), adapt=False, read_every_steps=4)
    with caplog.at_level(logging.INFO, logger="keras_amp_plus"):
        history = train(model, [monitor], epochs=1)
    assert history.history["overflow_events"] == [STEPS_PER_EPOCH]
    events = [r for r in read_jsonl(str(tmp_path)) if r["type"] == "overflow"]
    assert [e["step"] for e in events] == list(range(1, STEPS_PER_EPOCH + 1))
    advice = [r for r in caplog.records if "LossScaleOptimizer.guard" in r.message]
    if scaler == "none":
        assert "loss_scale" not in history.history
        assert len(advice) == 1 and advice[0].levelname == "WARNING"
        # Unguarded, the first update made the weights NaN: the replay must not
        # blame the layer whose weights are broken.
        assert all(e["layers"] == [] for e in events)
        assert all("non-finite weights in d1" in e["evidence"] for e in events)
        # Nothing skipped them: the series says what it counts.
        accumulator = read_tensorboard(str(tmp_path))
        assert "amp/skipped_steps" not in accumulator.Tags()["tensors"]
        nonfinite = scalar_series(accumulator, "amp/nonfinite_steps")
        assert max(nonfinite.values()) == STEPS_PER_EPOCH
    else:
        assert {tuple(e["layers"]) for e in events} == {("hot",)}
        assert history.history["loss_scale"] == [1.0]
        assert advice == []
        assert int(model.optimizer.overflow_count.numpy()) == STEPS_PER_EPOCH


def test_scaler_calibration_is_not_blamed_on_a_layer(tmp_path):
    # A huge initial scale makes the first steps overflow in backward only.
    model = overflow_model("mixed_float16", hot_scale=1.0, initial_scale=2.0**24)
    monitor = AMPMonitor(str(tmp_path), read_every_steps=2)
    history = train(model, [monitor], epochs=2)
    events = [r for r in read_jsonl(str(tmp_path)) if r["type"] == "overflow"]
    assert 0 < len(events) == sum(history.history["overflow_events"])
    assert all(e["direction"] == "backward" for e in events)
    for event in events:
        # Attributed to the implicated layer closest to the loss.
        assert event["layers"] == event["implicated_layers"][-1:]
        assert event["scale_before"] > 1.0
    assert monitor.lists.deny_layers == ()
    assert [r for r in read_jsonl(str(tmp_path)) if r["type"] == "list_change"] == []


@pytest.mark.parametrize("jit_compile", [False, True])
def test_exact_counts_with_steps_per_execution(tmp_path, jit_compile):
    # Batch hooks fire once per 4 steps; the ring still yields every event.
    # Under XLA the 4 steps loop over the compiled step and the stash around it.
    model = overflow_model("mixed_float16", on_min_scale="ignore")
    model.compile(
        model.optimizer,
        loss="mse",
        steps_per_execution=4,
        auto_scale_loss=False,
        jit_compile=jit_compile,
    )
    monitor = AMPMonitor(str(tmp_path), adapt=False, read_every_steps=4)
    history = train(model, [monitor], epochs=2)
    assert history.history["overflow_events"] == [STEPS_PER_EPOCH] * 2
    events = [r for r in read_jsonl(str(tmp_path)) if r["type"] == "overflow"]
    assert [e["step"] for e in events] == list(range(1, 2 * STEPS_PER_EPOCH + 1))
    # Every step overflowed: the rate counts the steps, not the batch hooks.
    rates = scalar_series(read_tensorboard(str(tmp_path)), "amp/overflow_rate")
    assert rates == {0: 1.0, 1: 1.0}


@pytest.mark.onednn  # the grappler engine (see conftest.py)
def test_graph_engine_lists_are_applied_and_restored(tmp_path):
    variable = "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_DENYLIST_ADD"
    before = os.environ.get(variable)
    seen = []

    class ReadEnvironment(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            seen.append(os.environ.get(variable))

    model = overflow_model("float32", scaler="none", hot_scale=1.0)
    lists = PrecisionLists(deny_ops=("Softmax",))
    monitor = AMPMonitor(str(tmp_path), engine="grappler", lists=lists)
    train(model, [monitor, ReadEnvironment()], epochs=1)
    assert "Softmax" in seen[0].split(",")
    assert os.environ.get(variable) == before
    assert monitor.lists == lists


def test_a_denied_layer_earns_low_precision_back(tmp_path):
    # `hot` overflows in epoch 0 only (its kernel is then scaled down, like a
    # transient instability); after `patience` clean epochs it returns.
    class CalmDown(keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            if epoch == 0:
                kernel = self.model.get_layer("hot").kernel
                kernel.assign(kernel * 1e-4)

    model = overflow_model("mixed_float16")
    monitor = AMPMonitor(str(tmp_path), read_every_steps=4, patience=1, cooldown=0)
    history = train(model, [monitor, CalmDown()], epochs=3)
    assert history.history["overflow_events"][0] == STEPS_PER_EPOCH
    assert history.history["overflow_events"][2] == 0
    changes = [r for r in read_jsonl(str(tmp_path)) if r["type"] == "list_change"]
    assert [(c["epoch"], c["from"], c["to"]) for c in changes] == [
        (0, None, "deny"),
        (1, "deny", "allow"),
    ]
    assert monitor.lists.allow_layers == ("hot",) and monitor.lists.deny_layers == ()
    assert model.get_layer("hot").compute_dtype == "float16"


def test_a_later_fit_decides_on_the_epochs_of_the_record(tmp_path):
    # The rule's memory spans fits; a second `fit` numbers its epochs from 0
    # again, the record (and the JSON lines) after the first's.
    model = overflow_model("mixed_float16")
    kernel = model.get_layer("hot").kernel
    hot = kernel.numpy()
    kernel.assign(hot * 1e-4)
    monitor = AMPMonitor(str(tmp_path), read_every_steps=4)
    train(model, [monitor], epochs=2)
    kernel.assign(hot)
    train(model, [monitor], epochs=1)
    changes = [r for r in read_jsonl(str(tmp_path)) if r["type"] == "list_change"]
    assert [(c["epoch"], c["to"]) for c in changes] == [(2, "deny")]
    assert "in epoch 2," in changes[0]["reason"]


def test_the_scale_put_back_is_the_one_before_the_overflows_that_denied(tmp_path):
    # `hot` overflows in epochs 0 and 2, calm in between, and is denied at
    # epoch 2: the scale goes back to where it stood before epoch 2's
    # overflows, not to the one before epoch 0's, long since left.
    class CalmInEpochOne(keras.callbacks.Callback):
        def on_epoch_begin(self, epoch, logs=None):
            kernel = self.model.get_layer("hot").kernel
            if epoch in (1, 2):
                kernel.assign(kernel * (1e-4 if epoch == 1 else 1e4))

    model = overflow_model("mixed_float16", on_min_scale="ignore")
    monitor = AMPMonitor(
        str(tmp_path), read_every_steps=4, deny_threshold=STEPS_PER_EPOCH + 1
    )
    history = train(model, [CalmInEpochOne(), monitor], epochs=3)
    assert history.history["overflow_events"] == [STEPS_PER_EPOCH, 0, STEPS_PER_EPOCH]
    records = read_jsonl(str(tmp_path))
    events = [r for r in records if r["type"] == "overflow" and r["epoch"] == 2]
    changes = [r for r in records if r["type"] == "list_change"]
    assert [(c["epoch"], c["name"], c["to"]) for c in changes] == [(2, "hot", "deny")]
    restored = [r for r in records if r["type"] == "scale_restored"]
    assert [r["to"] for r in restored] == [events[0]["scale_before"]]
    assert events[0]["scale_before"] < 2.0**15


class CustomStepModel(keras.Model):
    """A `train_step` that computes its loss without `compute_loss`."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            y_pred = keras.ops.cast(self(x, training=True), "float32")
            loss = keras.ops.mean(keras.ops.square(y_pred - y))
            scaled = self.optimizer.scale_loss(loss)
        gradients = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        return {"loss": loss}


class BatchLosses(keras.callbacks.Callback):
    """Keep every batch's logged loss."""

    def __init__(self):
        super().__init__()
        self.losses = []

    def on_train_batch_end(self, batch, logs=None):
        self.losses.append(float(logs["loss"]))


@pytest.mark.parametrize("jit_compile", (False, True))
def test_custom_train_step_logs_of_its_own_are_left_alone(tmp_path, jit_compile):
    # The step returns its own loss under the name of the compiled loss
    # tracker, which it never updates: no step is skipped, so the monitor
    # changes nothing (not 0.0 per batch, not `inf` for the epoch).
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = CustomStepModel(inputs, keras.layers.Dense(1, name="head")(inputs))
    model.compile(
        LossScaleOptimizer(keras.optimizers.SGD(0.01), on_min_scale="ignore"),
        jit_compile=jit_compile,
    )
    x = np.random.default_rng(0).normal(size=(32, 4)).astype("float32")
    y = np.ones((32, 1), "float32")
    kernel, bias = (np.float64(w) for w in model.get_layer("head").get_weights())
    batches = BatchLosses()
    history = model.fit(
        x,
        y,
        batch_size=16,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[AMPMonitor(str(tmp_path)), batches],
    )
    expected = []  # float64 SGD on the two batches
    for start in (0, 16):
        xb, yb = x[start : start + 16].astype("float64"), y[start : start + 16]
        error = xb @ kernel + bias - yb
        expected.append(np.mean(error**2))
        kernel = kernel - 0.01 * 2 * xb.T @ error / error.size
        bias = bias - 0.01 * 2 * error.sum(axis=0) / error.size
    assert int(model.optimizer.overflow_count) == 0
    np.testing.assert_allclose(batches.losses, expected, rtol=1e-5)
    assert np.isfinite(history.history["loss"][0])


class PerExampleLossModel(keras.Model):
    """A `train_step` logging the batch's per-example losses as `loss`."""

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            losses = keras.ops.square(self(x, training=True) - y)[:, 0]
            scaled = self.optimizer.scale_loss(keras.ops.mean(losses))
        gradients = tape.gradient(scaled, self.trainable_variables)
        self.optimizer.apply(gradients, self.trainable_variables)
        return {"loss": losses}


def test_custom_train_step_logs_of_another_shape_are_left_alone(tmp_path):
    keras.config.set_dtype_policy("float32")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    model = PerExampleLossModel(inputs, keras.layers.Dense(1, name="head")(inputs))
    model.compile(LossScaleOptimizer(keras.optimizers.SGD(0.01)))
    x = np.random.default_rng(0).normal(size=(16, 4)).astype("float32")
    y = np.ones((16, 1), "float32")
    kernel, bias = (np.float64(w) for w in model.get_layer("head").get_weights())
    logged = []
    model.fit(
        x,
        y,
        batch_size=16,
        epochs=1,
        shuffle=False,
        verbose=0,
        callbacks=[
            AMPMonitor(str(tmp_path)),
            keras.callbacks.LambdaCallback(
                on_train_batch_end=lambda batch, logs: logged.append(logs["loss"])
            ),
        ],
    )
    expected = (x.astype("float64") @ kernel + bias - y)[:, 0] ** 2
    np.testing.assert_allclose(np.asarray(logged[0]), expected, rtol=1e-5)


@pytest.mark.parametrize("scaler", ["ours", "keras"])
def test_custom_train_step_forward_overflow_is_still_replayed(tmp_path, scaler):
    # The loss is not seen by the monitor; all gradients non-finite on every
    # event (ours records them; Keras's scaler records none, so any skipped
    # step may be one) makes it replay the batch, which names `hot`.
    reference = overflow_model("mixed_float16")
    model = CustomStepModel(reference.inputs, reference.outputs)
    wrap = {"ours": LossScaleOptimizer, "keras": keras.optimizers.LossScaleOptimizer}
    model.compile(wrap[scaler](keras.optimizers.Adam(0.1)))
    monitor = AMPMonitor(str(tmp_path), read_every_steps=4)
    history = train(model, [monitor], epochs=2)
    # Epoch 1 may hold the scaler's search from the scale put back (untrusted).
    assert history.history["overflow_events"][0] == STEPS_PER_EPOCH
    events = [
        r for r in read_jsonl(str(tmp_path)) if r["type"] == "overflow" and r["trusted"]
    ]
    assert {(tuple(e["layers"]), e["direction"]) for e in events} == {
        (("hot",), "forward")
    }
    # Unseen, the loss is not said to have stayed finite.
    assert not any("loss stayed finite" in e["evidence"] for e in events)
    # From the first step on, at the scaler's initial scale too.
    first_epoch = [
        r
        for r in read_jsonl(str(tmp_path))
        if r["type"] == "overflow" and r["epoch"] == 0
    ]
    assert all(e["layers"] == ["hot"] for e in first_epoch)
    assert first_epoch[0]["scale_before"] == 2.0**15
    assert monitor.lists.deny_layers == ("hot",)

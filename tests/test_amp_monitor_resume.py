"""Nothing lost: BackupAndRestore resumes, model.save/load_model, get_config."""

import os

import keras
import pytest
from conftest import (
    STEPS_PER_EPOCH,
    overflow_model,
    read_jsonl,
    regression_data,
    train,
)

from keras_amp_plus.callbacks import AMPMonitor


class Interrupt(keras.callbacks.Callback):
    """Raise in the middle of epoch `epoch`, after the monitor's reads."""

    def __init__(self, epoch, batch):
        super().__init__()
        self.epoch, self.batch = epoch, batch
        self.current = None

    def on_epoch_begin(self, epoch, logs=None):
        self.current = epoch

    def on_train_batch_end(self, batch, logs=None):
        if self.current == self.epoch and batch == self.batch:
            raise RuntimeError("interrupted")


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

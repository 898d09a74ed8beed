"""A corrupted record and a layer's overflow read together: each gets its own verdict.

The replay keeps one batch, the last overflow step's; events read together
share its verdict. A step whose own batch held Inf/NaN is bad data whatever
that verdict says, and a step whose verdict would come from another step's
bad batch is not replayed: no layer is blamed (and denied) for a bad record.
"""

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import read_jsonl, use_policy

from keras_amp_plus.callbacks import AMPMonitor
from keras_amp_plus.optimizers import LossScaleOptimizer

BATCH = 16
BAD_RECORD_STEP, OVERFLOW_STEP = 1, 4  # of one epoch of four steps


def _data(bad_step, overflow_step):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * BATCH, 8)).astype("float32")
    y = rng.normal(size=(4 * BATCH, 1)).astype("float32")
    x[(bad_step - 1) * BATCH + 3, 3] = np.nan  # a corrupted record
    x[(overflow_step - 1) * BATCH + 2] *= 1e6  # beyond float16 in `embed`
    return x, y


def _model(scaler):
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, name="embed")(inputs)
    outputs = keras.layers.Dense(1, dtype="float32", name="head")(hidden)
    model = keras.Model(inputs, outputs)
    optimizer = keras.optimizers.Adam()
    if scaler == "ours":
        optimizer = LossScaleOptimizer(optimizer, on_min_scale="ignore")
    else:
        optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    return model, optimizer


def _overflow_events(tmp_path, bad_step, overflow_step, scaler, jit_compile):
    use_policy("mixed_float16")
    model, optimizer = _model(scaler)
    model.compile(optimizer, "mse", jit_compile=jit_compile)
    # Both events in one read (the default reads every 64 steps), and two
    # attributed events would deny a layer.
    monitor = AMPMonitor(str(tmp_path), deny_threshold=2)
    x, y = _data(bad_step, overflow_step)
    model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    records = read_jsonl(str(tmp_path))
    events = {r["step"]: r for r in records if r["type"] == "overflow"}
    return events, monitor


@pytest.mark.parametrize("scaler", ("ours", "keras"))
@pytest.mark.parametrize("jit_compile", (False, True))
def test_a_bad_record_before_an_overflow_is_not_blamed_on_the_layer(
    tmp_path, scaler, jit_compile
):
    events, monitor = _overflow_events(
        tmp_path, BAD_RECORD_STEP, OVERFLOW_STEP, scaler, jit_compile
    )
    assert sorted(events) == [BAD_RECORD_STEP, OVERFLOW_STEP]
    bad = events[BAD_RECORD_STEP]
    assert bad["layers"] == [] and bad["direction"] == "forward"
    assert bad["evidence"] == f"batch of step {BAD_RECORD_STEP}: bad_data"
    overflow = events[OVERFLOW_STEP]
    assert overflow["layers"] == ["embed"]
    assert overflow["evidence"].startswith(f"replay of step {OVERFLOW_STEP}: ")
    # One event against `embed` is below the threshold of two.
    assert monitor.lists.deny_layers == ()


@pytest.mark.parametrize("jit_compile", (False, True))
def test_an_overflow_before_a_bad_record_is_not_called_bad_data(tmp_path, jit_compile):
    # The batch kept is the bad record's: the earlier overflow's is gone, so
    # it is said to be unreplayed rather than given the bad batch's verdict.
    overflow_step, bad_step = 1, 4
    events, monitor = _overflow_events(
        tmp_path, bad_step, overflow_step, "ours", jit_compile
    )
    assert sorted(events) == [overflow_step, bad_step]
    assert events[bad_step]["evidence"] == f"batch of step {bad_step}: bad_data"
    unreplayed = events[overflow_step]
    assert unreplayed["layers"] == [] and unreplayed["direction"] == "forward"
    assert unreplayed["evidence"].startswith(
        f"not replayed: the batch kept is step {bad_step}'s"
    )
    assert monitor.lists.deny_layers == ()


class _RefuseHugeValues(keras.layers.Layer):
    """A float32 check a pipeline might have: it raises on a broken record."""

    def call(self, x):
        largest = tf.reduce_max(tf.abs(x))
        tf.debugging.assert_less(largest, 1e9, message="a broken record")
        return x


def test_events_are_written_when_the_replay_itself_fails(tmp_path):
    # The step stopped by a broken record is the one whose batch is kept:
    # replaying it raises too. The overflow events read at the stop are
    # written without a layer, never dropped.
    use_policy("mixed_float16")
    inputs = keras.Input((8,))
    checked = _RefuseHugeValues(dtype="float32")(inputs)
    hidden = keras.layers.Dense(16, name="hot")(checked)
    outputs = keras.layers.Dense(1, dtype="float32", name="head")(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(LossScaleOptimizer(keras.optimizers.SGD(0.0)), "mse")
    x = np.full((4 * BATCH, 8), 1e5, "float32")  # `hot` overflows every step
    x[2 * BATCH, 0] = 1e10  # the third step's batch is broken
    y = np.ones((4 * BATCH, 1), "float32")
    monitor = AMPMonitor(str(tmp_path), adapt=False)
    with pytest.raises(tf.errors.InvalidArgumentError, match="a broken record"):
        model.fit(x, y, batch_size=BATCH, shuffle=False, verbose=0, callbacks=[monitor])
    events = [r for r in read_jsonl(str(tmp_path)) if r["type"] == "overflow"]
    # Step 3 ran its ops (TensorFlow raises the failed check at the end).
    assert [e["step"] for e in events] == [1, 2, 3]
    assert all(e["layers"] == [] for e in events)
    assert all("replay_failed (InvalidArgumentError)" in e["evidence"] for e in events)

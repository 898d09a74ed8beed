"""Bad input fails early (at construction or on_train_begin) with clear errors."""

import keras
import numpy as np
import pytest
from conftest import overflow_model, read_jsonl, regression_data

from keras_amp_plus._lists.precision_lists import PrecisionLists
from keras_amp_plus.callbacks import AMPMonitor
from keras_amp_plus.optimizers import LossScaleOptimizer


def fit_one_epoch(model, monitor):
    x, y = regression_data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[monitor])


def test_unwritable_log_dir_fails_before_the_first_step(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    model = overflow_model("mixed_float16")
    kernel = model.get_layer("d1").kernel.numpy()
    monitor = AMPMonitor(str(blocker / "logs"))
    with pytest.raises(ValueError, match="cannot write to its `log_dir`") as info:
        fit_one_epoch(model, monitor)
    assert "Received: log_dir=" in str(info.value)
    np.testing.assert_array_equal(model.get_layer("d1").kernel.numpy(), kernel)
    assert int(model.optimizer.iterations.numpy()) == 0


@pytest.mark.parametrize(
    ("blocked", "make", "match"),
    (
        ("amp", "file", "TensorBoard run to .* which exists as a file"),
        ("amp_events.jsonl", "directory", "events to .* exists as a directory"),
        ("amp_state.json", "garbage", "is not a state file AMPMonitor can read"),
        ("amp_state.json", "list", "is not a state file AMPMonitor can read"),
    ),
)
def test_a_log_dir_holding_what_the_monitor_cannot_use_fails_first(
    tmp_path, blocked, make, match
):
    path = tmp_path / blocked
    if make == "directory":
        path.mkdir()
    else:
        contents = {"file": "x", "garbage": '{"snapshots": [', "list": "[1]"}
        path.write_text(contents[make])
    model = overflow_model("mixed_float16")
    monitor = AMPMonitor(str(tmp_path))
    with pytest.raises(ValueError, match=match) as info:
        fit_one_epoch(model, monitor)
    assert "Received: " in str(info.value)
    assert int(model.optimizer.iterations.numpy()) == 0
    # Keras calls no `on_train_end`: the model has its own step back.
    assert not set(model.__dict__) & {"train_step", "compute_loss"}
    x, y = regression_data()
    history = model.fit(x, y, batch_size=16, epochs=1, verbose=0)
    assert "overflow_events" not in history.history


def test_model_without_optimizer(tmp_path):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    monitor = AMPMonitor(str(tmp_path))
    monitor.set_model(model)
    with pytest.raises(ValueError, match="compiled with an optimizer"):
        monitor.on_train_begin()


@pytest.mark.parametrize("inner", ["ours", "keras"])
def test_a_loss_scaler_inside_keras_scaler_fails_before_the_first_step(tmp_path, inner):
    # Keras's scaler accepts one as its inner optimizer: both would unscale.
    model = overflow_model("mixed_float16", scaler=None)
    scalers = {"ours": LossScaleOptimizer, "keras": keras.optimizers.LossScaleOptimizer}
    nested = keras.optimizers.LossScaleOptimizer(scalers[inner](keras.optimizers.SGD()))
    model.compile(nested, "mse")
    kernel = model.get_layer("d1").kernel.numpy()
    with pytest.raises(ValueError, match="wrapping another one") as info:
        fit_one_epoch(model, AMPMonitor(str(tmp_path)))
    assert "Received: optimizer=LossScaleOptimizer wrapping " in str(info.value)
    assert "wrapping SGD" in str(info.value)
    np.testing.assert_array_equal(model.get_layer("d1").kernel.numpy(), kernel)


class _Subclassed(keras.Model):
    def __init__(self):
        super().__init__(name="subclassed")
        self.body = keras.Sequential([keras.layers.Dense(4), keras.layers.Dense(1)])

    def call(self, x):
        return self.body(x)


@pytest.mark.parametrize(
    "build",
    [_Subclassed, lambda: keras.Sequential([keras.layers.Dense(1)], name="seq")],
    ids=["subclassed", "sequential_without_input"],
)
def test_unbuilt_model_fails_before_the_first_step(build, tmp_path):
    # Such a model creates its variables in the first step; the optimizer's
    # state built before it would cover none of them and the first update
    # would fail with "Unknown variable" deep inside the step.
    model = build()
    model.compile(LossScaleOptimizer(keras.optimizers.Adam()), "mse")
    with pytest.raises(ValueError, match="needs a built model") as info:
        fit_one_epoch(model, AMPMonitor(str(tmp_path / "logs")))
    assert f"Received: model={model.name!r} with built=False" in str(info.value)
    assert "model(x[:1])" in str(info.value)
    assert not model.built and not model.optimizer.built
    assert not (tmp_path / "logs").exists()
    model(regression_data()[0][:1])  # what the message asks for
    history = model.fit(
        *regression_data(),
        batch_size=16,
        epochs=1,
        verbose=0,
        callbacks=[AMPMonitor(str(tmp_path / "logs"))],
    )
    assert np.isfinite(history.history["loss"][-1])


@pytest.mark.parametrize(
    ("engine", "error", "match"),
    [
        ("tpu", ValueError, "`engine` must be one of"),
        ("itex", ImportError, "Intel Extension for TensorFlow"),
    ],
)
def test_unknown_or_unavailable_engine(tmp_path, engine, error, match):
    model = overflow_model("mixed_float16")
    with pytest.raises(error, match=match):
        fit_one_epoch(model, AMPMonitor(str(tmp_path), engine=engine))
    assert int(model.optimizer.iterations.numpy()) == 0


def test_lists_naming_missing_layers(tmp_path):
    model = overflow_model("mixed_float16")
    monitor = AMPMonitor(str(tmp_path), lists=PrecisionLists(deny_layers=("hott",)))
    with pytest.raises(ValueError, match="Did you mean hot"):
        fit_one_epoch(model, monitor)


def test_op_lists_with_the_layer_engine(tmp_path):
    model = overflow_model("mixed_float16")
    monitor = AMPMonitor(
        str(tmp_path), engine="keras", lists=PrecisionLists(deny_ops=("Softmax",))
    )
    with pytest.raises(
        ValueError, match="works on layers; op-type lists need a graph engine"
    ):
        fit_one_epoch(model, monitor)


def test_read_interval_beyond_the_ring_capacity(tmp_path):
    model = overflow_model("mixed_float16", event_buffer_size=8)
    assert isinstance(model.optimizer, LossScaleOptimizer)
    with pytest.raises(ValueError, match="must not exceed the event ring"):
        fit_one_epoch(model, AMPMonitor(str(tmp_path), read_every_steps=9))


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"deny_threshold": 0}, ValueError),
        ({"patience": -1}, ValueError),
        ({"cooldown": 1.5}, ValueError),
        ({"read_every_steps": 0}, ValueError),
        ({"log_dir": 3}, TypeError),
        ({"lists": ["hot"]}, TypeError),
        ({"adapt": "yes"}, TypeError),
        ({"replay": 1}, TypeError),
    ],
)
def test_bad_arguments(kwargs, error):
    with pytest.raises(error, match="Received"):
        AMPMonitor(**kwargs)


def test_given_lists_apply_from_the_first_step(tmp_path):
    model = overflow_model("mixed_float16")
    monitor = AMPMonitor(str(tmp_path), lists={"deny_layers": ["hot"]})
    x, y = regression_data()
    model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[monitor])
    assert model.get_layer("hot").compute_dtype == "float32"
    # No forward overflow: `hot` ran in float32 from the first step. (The
    # scaler may still calibrate down from 2**15 with a backward overflow.)
    events = read_jsonl(str(tmp_path))
    assert [e for e in events if e.get("direction") == "forward"] == []
    assert monitor.lists == PrecisionLists(deny_layers=("hot",))


@pytest.mark.parametrize(
    "scaler, found",
    [
        ("guard", "a loss scale of at most 1"),
        ("none", "optimizer Adam without a loss scaler"),
        ("ours", None),
        ("keras", None),
    ],
)
def test_float16_without_a_moving_loss_scale_is_named_before_training(
    tmp_path, caplog, scaler, found
):
    model = overflow_model("mixed_float16", scaler=scaler, hot_scale=1.0)
    x, y = regression_data()
    with caplog.at_level("WARNING", logger="keras_amp_plus"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[AMPMonitor(str(tmp_path))])
    warnings = [
        r.getMessage()
        for r in caplog.records
        if "computes in float16" in r.getMessage()
    ]
    if found is None:
        assert warnings == []
    else:
        assert len(warnings) == 1 and found in warnings[0]
        assert "LossScaleOptimizer(optimizer)" in warnings[0]


def test_float16_without_a_scaler_is_named_once_per_optimizer(tmp_path, caplog):
    model = overflow_model("mixed_float16", scaler="none", hot_scale=1.0)
    x, y = regression_data()
    with caplog.at_level("WARNING", logger="keras_amp_plus"):
        for _ in range(2):  # a loop of fits: one warning
            model.fit(x, y, epochs=1, verbose=0, callbacks=[AMPMonitor(str(tmp_path))])
        model.compile(keras.optimizers.SGD(), loss="mse", auto_scale_loss=False)
        model.fit(x, y, epochs=1, verbose=0, callbacks=[AMPMonitor(str(tmp_path))])
    warnings = [
        r.getMessage()
        for r in caplog.records
        if "computes in float16" in r.getMessage()
    ]
    assert len(warnings) == 2
    assert "optimizer Adam without" in warnings[0]
    assert "optimizer SGD without" in warnings[1]


def test_bfloat16_under_the_guard_is_not_warned_of(tmp_path, caplog):
    model = overflow_model("mixed_bfloat16", scaler="guard", hot_scale=1.0)
    x, y = regression_data()
    with caplog.at_level("WARNING", logger="keras_amp_plus"):
        model.fit(x, y, epochs=1, verbose=0, callbacks=[AMPMonitor(str(tmp_path))])
    assert not any("computes in float16" in r.getMessage() for r in caplog.records)


def test_numpy_bools_are_bools():
    monitor = AMPMonitor(adapt=np.False_, replay=np.True_)
    assert monitor.get_config()["adapt"] is False
    assert monitor.get_config()["replay"] is True

"""The monitor's parts on their own: rule, attribution, lists, state, log."""

import json
import types

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_amp_plus._lists.precision_lists import PrecisionLists
from keras_amp_plus.callbacks import (
    _allocator_check as allocator_check,
)
from keras_amp_plus.callbacks import (
    _attribution as attribution,
)
from keras_amp_plus.callbacks import (
    _checks as checks,
)
from keras_amp_plus.callbacks import (
    _distribution as distribution,
)
from keras_amp_plus.callbacks import (
    _event_collector as event_collector,
)
from keras_amp_plus.callbacks import (
    _event_log as event_log,
)
from keras_amp_plus.callbacks import (
    _hardware_check as hardware_check,
)
from keras_amp_plus.callbacks import (
    _monitor_session as monitor_session,
)
from keras_amp_plus.callbacks import (
    _state as state,
)
from keras_amp_plus.callbacks import (
    _step_recorder as step_recorder,
)
from keras_amp_plus.callbacks._adaptation import AdaptationRule, Decision
from keras_amp_plus.callbacks._list_editor import ListEditor
from keras_amp_plus.engines import GrapplerEngine, ItexEngine, KerasEngine


def moves(decisions):
    return [(d.layer, d.to) for d in decisions]


def test_rule_denies_at_threshold_and_waits_with_doubling_patience():
    rule = AdaptationRule(deny_threshold=2, patience=2, cooldown=0, max_retries=1)
    assert moves(rule.decide(0, {"a": 1}, set())) == []  # below threshold
    assert moves(rule.decide(1, {"a": 2, "b": 5}, set())) == [
        ("a", "deny"),
        ("b", "deny"),
    ]
    denied = {"a", "b"}
    assert moves(rule.decide(2, {}, denied)) == []  # 1 clean epoch of 2
    # Epoch 3: both have 2 clean epochs; only one may return per epoch.
    assert moves(rule.decide(3, {}, denied)) == [("a", "allow")]
    assert moves(rule.decide(4, {}, denied - {"a"})) == [("b", "allow")]
    # `a` overflows again: denied again, now waits 2 * 2 epochs ...
    assert moves(rule.decide(5, {"a": 3}, set())) == [("a", "deny")]
    assert rule.wait_epochs("a") == 4
    for epoch in range(6, 12):
        # ... and after max_retries=1 return it stays in float32 for good.
        assert moves(rule.decide(epoch, {}, {"a"})) == []


def test_rule_cooldown_spaces_returns_and_state_round_trips():
    rule = AdaptationRule(deny_threshold=1, patience=1, cooldown=2)
    rule.decide(0, {"a": 1, "b": 1}, set())
    assert moves(rule.decide(1, {}, {"a", "b"})) == [("a", "allow")]
    copy = AdaptationRule(deny_threshold=1, patience=1, cooldown=2)
    copy.set_state(json.loads(json.dumps(rule.get_state())))
    for r in (rule, copy):
        assert moves(r.decide(2, {}, {"b"})) == []
        assert moves(r.decide(3, {}, {"b"})) == []
        assert moves(r.decide(4, {}, {"b"})) == [("b", "allow")]


def test_rule_never_returns_layers_the_user_denied():
    rule = AdaptationRule(deny_threshold=1, patience=1, cooldown=0)
    for epoch in range(5):
        assert rule.decide(epoch, {}, {"user_denied"}) == []


def sequential_model():
    return keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, name="first"),
            keras.layers.BatchNormalization(name="bn"),
            keras.layers.Dense(4, name="middle"),
            keras.layers.Dense(1, name="last"),
        ]
    )


def test_backward_origin_is_the_implicated_layer_closest_to_the_loss():
    model = sequential_model()
    index = attribution.LayerIndex(model)
    # Layers are named by their name chain from the model down.
    path = {layer.name: index.chain(layer) for layer in model.layers}
    variables = {v.path.split("/", 1)[1]: v.path for v in model.trainable_variables}
    implicated = index.layers_of_variables(
        [variables[name] for name in ("middle/kernel", "first/bias", "bn/gamma")]
    )
    assert implicated == [path["first"], path["bn"], path["middle"]]  # forward
    assert index.backward_origin(implicated) == path["middle"]
    assert index.backward_origin([]) is None


@pytest.mark.parametrize("policy", ["float32", "mixed_float16", "mixed_bfloat16"])
def test_forward_replay_names_the_overflowing_layer(policy):
    keras.config.set_dtype_policy(policy)
    model = sequential_model()
    model.get_layer("middle").kernel.assign(np.full((4, 4), 1e38, "float32"))
    model.get_layer("first").kernel.assign(np.ones((3, 4), "float32"))
    x = np.array([[10.0, 0.0, 1.0], [-10.0, 5.0, 1.0]], "float32")
    moving_mean = model.get_layer("bn").moving_mean.numpy()
    index = attribution.LayerIndex(model)
    found = attribution.find_forward_overflow(model, (x, None), index.layers)
    assert found == {"layer": model.get_layer("middle").path, "reason": "output"}
    # The replay leaves no trace: calls restored, batch statistics untouched.
    assert all("call" not in layer.__dict__ for layer in model.layers)
    np.testing.assert_array_equal(model.get_layer("bn").moving_mean, moving_mean)
    bad = np.array([[np.nan, 0.0, 0.0]], "float32")
    assert attribution.find_forward_overflow(model, (bad,), index.layers) == {
        "layer": None,
        "reason": "bad_data",
    }


def test_forward_replay_input_cast_overflow():
    # `wide` runs in float32 and outputs 1e5; `narrow` casts it to float16.
    keras.config.set_dtype_policy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((2,)),
            keras.layers.Dense(2, name="wide", dtype="float32"),
            keras.layers.Dense(1, name="narrow"),
        ]
    )
    model.get_layer("wide").kernel.assign(np.full((2, 2), 1e5, "float32"))
    index = attribution.LayerIndex(model)
    found = attribution.find_forward_overflow(
        model, (np.ones((1, 2), "float32"),), index.layers
    )
    assert found == {"layer": model.get_layer("narrow").path, "reason": "input_cast"}


def test_forward_replay_blames_the_container_for_values_gone_bad_between_layers():
    # `wide` outputs 1e6 in float32, but `after` receives what an exp between
    # layers made of `small`'s output: not a cast of `wide`'s output.
    keras.config.set_dtype_policy("mixed_float16")
    inputs = keras.Input((4,))
    big = keras.initializers.Constant(3e5)
    wide = keras.layers.Dense(4, dtype="float32", name="wide", kernel_initializer=big)
    hidden = keras.layers.Rescaling(1e-6, dtype="float32", name="tame")(wide(inputs))
    ones = keras.initializers.Constant(1.0)
    hidden = keras.layers.Dense(4, name="small", kernel_initializer=ones)(hidden)
    hidden = keras.ops.exp(hidden * 30.0)  # overflows float16, no layer's own
    backbone = keras.Model(
        inputs, keras.layers.Dense(4, name="after")(hidden), name="backbone"
    )
    model = keras.Sequential([keras.Input((4,)), backbone, keras.layers.Dense(1)])
    index = attribution.LayerIndex(model)
    found = attribution.find_forward_overflow(
        model, (np.ones((2, 4), "float32"),), index.layers
    )
    assert found == {"layer": "backbone", "reason": "output"}


def test_list_editor_layer_level_is_reversible():
    keras.config.set_dtype_policy("mixed_float16")
    model = sequential_model()
    index = attribution.LayerIndex(model)
    last = index.chain(model.get_layer("last"))
    editor = ListEditor(KerasEngine(), index)
    lists = PrecisionLists(allow_layers=(last,))
    denied, changes = editor.apply(lists, Decision(last, "deny", "r", {}))
    assert denied.deny_layers == (last,) and denied.allow_layers == ()
    assert changes == [
        {"kind": "layer", "name": last, "from": "allow", "to": "deny", "layer": last}
    ]
    assert editor.denied_layers(model, denied) == {last}
    back, _ = editor.apply(denied, Decision(last, "allow", "r", {}))
    assert back == lists


def test_list_editor_op_level_maps_layers_to_op_types():
    model = sequential_model()
    index = attribution.LayerIndex(model)
    editor = ListEditor(GrapplerEngine(dump_graphs=False), index)
    path = {layer.name: index.chain(layer) for layer in model.layers}
    lists = PrecisionLists(infer_ops=("BiasAdd",))
    first, changes = editor.apply(lists, Decision(path["first"], "deny", "r", {}))
    assert {"MatMul", "BiasAdd"} <= set(first.deny_ops)
    assert ("BiasAdd", "infer") in {(c["name"], c["from"]) for c in changes}
    both, _ = editor.apply(first, Decision(path["middle"], "deny", "r", {}))
    # `first` returns, but `middle` still needs MatMul and BiasAdd denied.
    partly, restored = editor.apply(both, Decision(path["first"], "allow", "r", {}))
    assert restored == [] and partly == both
    final, _ = editor.apply(partly, Decision(path["middle"], "allow", "r", {}))
    assert final == lists


def test_a_state_of_before_run_epochs_numbers_epochs_per_fit():
    # Files written before `run_epoch_offset` numbered records per `fit`.
    old = state.MonitorState.from_dict({"epoch": 2, "epoch_offset": 5})
    assert old.run_epoch_offset == 5
    new = state.MonitorState.from_dict(state.MonitorState(epoch_offset=5).to_dict())
    assert new.run_epoch_offset == 0


@pytest.mark.parametrize(
    ("name", "direction"),
    [
        ("loss", "down"),
        ("out_loss", "down"),
        ("accuracy", "up"),
        ("out_accuracy", "up"),
        ("out_mae_1", "down"),
        ("sparse_categorical_accuracy", "up"),
        ("mean", None),
    ],
)
def test_a_result_name_finds_its_metric_direction(name, direction):
    directions = {
        "accuracy": "up",
        "sparse_categorical_accuracy": "up",
        "mae": "down",
        "categorical_accuracy": "up",
    }
    assert step_recorder._direction_of(name, directions) == direction


def test_state_snapshots_keep_recent_epochs(tmp_path):
    for epoch in range(5):
        state.save_snapshot(str(tmp_path), state.MonitorState(epoch=epoch))
    snapshots = state.load_snapshots(str(tmp_path))
    assert sorted(snapshots) == [2, 3, 4]
    # Rewriting an epoch (a resumed run) drops the later, abandoned ones.
    state.save_snapshot(str(tmp_path), state.MonitorState(epoch=3, total_steps=7))
    snapshots = state.load_snapshots(str(tmp_path))
    assert sorted(snapshots) == [2, 3] and snapshots[3].total_steps == 7
    (tmp_path / state.STATE_FILE).write_text(json.dumps({"format": 99}))
    with pytest.raises(ValueError, match="another version"):
        state.load_snapshots(str(tmp_path))


class _CountingFile:
    """A file that counts its flushes (each one uploads the file on gs://)."""

    def __init__(self, file):
        self.file, self.flushes = file, 0

    def write(self, text):
        self.file.write(text)

    def flush(self):
        self.flushes += 1
        self.file.flush()

    def close(self):
        self.file.close()


def test_events_read_together_are_written_with_one_flush(tmp_path):
    log = event_log.EventLog(str(tmp_path))
    log.open(keep_lines=None)
    log._file = counting = _CountingFile(log._file)
    log.write_records([{"i": i} for i in range(50)])
    log.write_records([])
    assert counting.flushes == 1 and log.lines_written == 50
    # Flushed: readable before the log is closed, as after a crash.
    lines = (tmp_path / event_log.EVENTS_FILE).read_text().splitlines()
    assert [json.loads(line)["i"] for line in lines] == list(range(50))
    log.close()


def test_a_line_cut_short_by_a_crash_is_dropped_not_joined(tmp_path):
    path = tmp_path / event_log.EVENTS_FILE
    path.write_text('{"i": 0}\n{"i": 1}\n{"i"')
    log = event_log.EventLog(str(tmp_path))
    log.open(keep_lines=None)
    log.write_record({"i": 2})
    log.close()
    lines = path.read_text().splitlines()
    assert [json.loads(line)["i"] for line in lines] == [0, 1, 2]
    assert log.lines_written == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["amp", path.name]


def test_event_log_keeps_lines_on_resume_and_writes_tensorboard(tmp_path):
    log = event_log.EventLog(str(tmp_path))
    log.open(keep_lines=None)
    for i in range(3):
        log.write_record({"i": i})
    log.scalars({"amp/loss_scale": 4.0, "amp/none": None}, step=1)
    log.close()
    log = event_log.EventLog(str(tmp_path))
    log.open(keep_lines=2)
    log.write_record({"i": 9})
    log.close()
    lines = (tmp_path / event_log.EVENTS_FILE).read_text().splitlines()
    assert [json.loads(line)["i"] for line in lines] == [0, 1, 9]
    files = list((tmp_path / "amp").iterdir())
    records = []
    for file in files:
        for event in tf.compat.v1.train.summary_iterator(str(file)):
            for value in event.summary.value:
                records.append((event.step, value.tag, tf.make_ndarray(value.tensor)))
    assert records == [(1, "amp/loss_scale", np.float32(4.0))]


def test_list_editor_returns_unlisted_layers_to_the_allow_list():
    keras.config.set_dtype_policy("mixed_float16")
    model = sequential_model()
    index = attribution.LayerIndex(model)
    last = index.chain(model.get_layer("last"))
    editor = ListEditor(KerasEngine(), index)
    denied, _ = editor.apply(PrecisionLists(), Decision(last, "deny", "r", {}))
    back, changes = editor.apply(denied, Decision(last, "allow", "r", {}))
    assert back == PrecisionLists(allow_layers=(last,))
    assert [(c["from"], c["to"]) for c in changes] == [("deny", "allow")]


def _forward_event(layers, reason):
    return {
        "direction": "forward",
        "layers": layers,
        "evidence": f"replay of step 3: {reason}",
    }


def test_workers_agree_on_the_layer_and_on_bad_data(monkeypatch):
    # Two workers, one collective: worker 1 calls with its flags, worker 0's
    # call then reads the OR of both (as the all-reduce gives every worker).
    names = ["d1", "hot"]
    worker_1 = [
        _forward_event(["hot"], "output"),
        _forward_event([], attribution.BAD_DATA),
        _forward_event([], "not_reproduced"),
    ]
    worker_0 = [_forward_event([], "not_reproduced") for _ in range(3)]
    flags = {}

    def any_across_workers(strategy, local):
        if "first" not in flags:
            flags["first"] = local
            return local
        return local | flags["first"]

    monkeypatch.setattr(distribution, "is_multi_worker", lambda strategy: True)
    monkeypatch.setattr(distribution, "any_across_workers", any_across_workers)
    distribution.agree_on_layers(None, worker_1, names)
    distribution.agree_on_layers(None, worker_0, names)
    assert [e["layers"] for e in worker_0] == [["hot"], [], []]
    assert worker_0[0]["evidence"] == "replay of another worker's batch"
    assert worker_0[1]["evidence"] == "replay of another worker's batch: bad_data"
    assert worker_0[2]["evidence"] == "replay of step 3: not_reproduced"
    # The worker whose replay found it keeps its own evidence.
    assert worker_1[1]["evidence"] == "replay of step 3: bad_data"


@pytest.mark.parametrize(
    "engine, warned",
    [
        (GrapplerEngine(), "engine 'grappler' rewrites its ops"),
        (ItexEngine(data_type="BFLOAT16"), "engine 'itex' rewrites its ops"),
        (ItexEngine(data_type="FLOAT16"), None),
        (KerasEngine(), None),
    ],
    ids=["grappler", "ITEX-bfloat16", "ITEX-float16", "keras"],
)
def test_a_graph_engines_bfloat16_is_named_where_bfloat16_is_slow(
    monkeypatch, caplog, engine, warned
):
    slower = {"verdict": "slower", "reason": "bfloat16 is emulated here (test)"}
    monkeypatch.setattr(
        hardware_check._bfloat16_outlook, "bfloat16_outlook", lambda: slower
    )
    monkeypatch.setattr(hardware_check, "_warned", [])
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])  # float32
    with caplog.at_level("WARNING", logger="keras_amp_plus"):
        hardware_check.warn_once_if_bfloat16_is_slow(model, engine)
    messages = [r.getMessage() for r in caplog.records]
    if warned is None:
        assert messages == []
    else:
        assert len(messages) == 1 and warned in messages[0]
        assert "bfloat16 is emulated here (test)" in messages[0]
        assert "Train in float32" in messages[0]


@pytest.mark.parametrize(
    "engine, warned",
    [(ItexEngine(data_type="FLOAT16"), True), (GrapplerEngine(), False)],
    ids=["ITEX-float16", "grappler"],
)
def test_a_graph_engines_float16_without_a_scaler_is_named(caplog, engine, warned):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])  # float32
    model.compile(keras.optimizers.SGD(), loss="mse")
    with caplog.at_level("WARNING", logger="keras_amp_plus"):
        checks.warn_if_float16_is_unscaled(model, engine)
    messages = [r.getMessage() for r in caplog.records]
    if warned:
        assert len(messages) == 1
        assert "engine 'itex' rewrites its ops" in messages[0]
        assert "optimizer SGD without a loss scaler" in messages[0]
    else:
        assert messages == []


def test_the_cpus_bfloat16_verdict_is_not_given_for_an_xpu(monkeypatch, caplog):
    slower = {"verdict": "slower", "reason": "bfloat16 is emulated here (test)"}
    monkeypatch.setattr(
        hardware_check._bfloat16_outlook, "bfloat16_outlook", lambda: slower
    )
    monkeypatch.setattr(hardware_check._hardware, "has_xpu", lambda: True)
    monkeypatch.setattr(hardware_check, "_warned", [])
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    with caplog.at_level("WARNING", logger="keras_amp_plus"):
        hardware_check.warn_once_if_bfloat16_is_slow(model, GrapplerEngine())
    assert caplog.records == []


def _unpooled(monkeypatch):
    """oneDNN off and the BFC allocator unset: CPU tensors come from malloc."""
    monkeypatch.setattr(allocator_check._compat, "onednn_enabled", lambda: False)
    monkeypatch.delenv(allocator_check._hardware.ALLOCATOR_VARIABLE, raising=False)
    monkeypatch.setattr(allocator_check, "_warned", [])


def test_an_unpooled_allocator_is_named_once_with_its_fix(monkeypatch, caplog):
    _unpooled(monkeypatch)
    with caplog.at_level("WARNING", logger="keras_amp_plus"):
        allocator_check.warn_once_if_allocator_unpooled()
        allocator_check.warn_once_if_allocator_unpooled()
    (message,) = [r.getMessage() for r in caplog.records]
    assert "oneDNN is off here and TF_CPU_ALLOCATOR_USE_BFC is unset" in message
    assert "Set TF_CPU_ALLOCATOR_USE_BFC=1 in the environment before" in message


@pytest.mark.parametrize(
    "setting", ("bfc_set", "bfc_off", "onednn_on", "itex", "xpu"), ids=str
)
def test_a_pooled_allocator_or_another_device_is_not_named(
    setting, monkeypatch, caplog
):
    _unpooled(monkeypatch)
    if setting == "bfc_set":
        monkeypatch.setenv(allocator_check._hardware.ALLOCATOR_VARIABLE, "1")
    if setting == "bfc_off":  # an explicit choice is the user's
        monkeypatch.setenv(allocator_check._hardware.ALLOCATOR_VARIABLE, "0")
    if setting == "onednn_on":
        monkeypatch.setattr(allocator_check._compat, "onednn_enabled", lambda: True)
    if setting == "itex":
        monkeypatch.setattr(allocator_check._compat, "itex_module", lambda: object())
    if setting == "xpu":
        monkeypatch.setattr(allocator_check._hardware, "has_xpu", lambda: True)
    with caplog.at_level("WARNING", logger="keras_amp_plus"):
        allocator_check.warn_once_if_allocator_unpooled()
    assert caplog.records == []


def test_fit_names_an_unpooled_allocator_before_the_first_step(
    monkeypatch, caplog, tmp_path
):
    from keras_amp_plus.callbacks import AMPMonitor

    _unpooled(monkeypatch)
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    model.compile(keras.optimizers.SGD(), loss="mse")
    x, y = np.ones((8, 4), "float32"), np.ones((8, 2), "float32")
    first_step = []
    step_logged = keras.callbacks.LambdaCallback(
        on_train_batch_begin=lambda batch, logs: first_step.append(len(caplog.records))
    )
    with caplog.at_level("WARNING", logger="keras_amp_plus"):
        model.fit(
            x,
            y,
            epochs=1,
            verbose=0,
            callbacks=[AMPMonitor(str(tmp_path)), step_logged],
        )
    allocator = [
        r for r in caplog.records if "TF_CPU_ALLOCATOR_USE_BFC" in r.getMessage()
    ]
    assert len(allocator) == 1
    assert caplog.records.index(allocator[0]) < first_step[0]


@pytest.mark.parametrize("suffix", ["", event_collector.LOSS_STAYED_FINITE])
@pytest.mark.parametrize(
    "reason, says",
    [
        (attribution.OUTPUT_OUTSIDE_ITS_POLICY, "Deny the layer around it"),
        ("input_cast", "cannot reach a cast"),
        ("output", "diverge"),
    ],
)
def test_why_a_denial_fails_reads_the_verdict_behind_any_suffix(reason, says, suffix):
    # A custom `train_step` leaves the loss unseen: the verdict then carries
    # a suffix, and the reason given must not change with it.
    session = types.SimpleNamespace(
        index=types.SimpleNamespace(by_path={}), engine=KerasEngine()
    )
    event = {"evidence": f"replay of step 3: {reason}{suffix}"}
    why = monitor_session.MonitorSession._why_denial_fails(session, "wrap/hot", event)
    assert says in why


def _overflow(direction, before, after, layers=("hot",)):
    return {
        "direction": direction,
        "scale_before": before,
        "scale_after": after,
        "layers": list(layers),
    }


@pytest.mark.parametrize(
    "events, expected",
    [
        # Forward overflows only: the scale before the first one.
        ([_overflow("forward", 2.0**15, 2.0**14)] * 2, 2.0**15),
        # A backward overflow since: not above the scale it backed off to.
        (
            [
                _overflow("forward", 2.0**15, 2.0**14),
                _overflow("backward", 2.0**14, 2.0**13, ("d1",)),
                _overflow("forward", 2.0**13, 2.0**12),
            ],
            2.0**13,
        ),
        # With hysteresis a backward overflow may not back off: kept as is.
        (
            [
                _overflow("forward", 2.0**15, 2.0**15),
                _overflow("backward", 2.0**15, 2.0**15, ("d1",)),
            ],
            2.0**15,
        ),
        # A backward overflow before the first forward one is the scaler's own.
        (
            [
                _overflow("backward", 2.0**15, 2.0**14, ("d1",)),
                _overflow("forward", 2.0**14, 2.0**13),
            ],
            2.0**14,
        ),
    ],
)
def test_the_scale_to_put_back_follows_the_backward_overflows_since(events, expected):
    scales = {}
    session = types.SimpleNamespace(_scales_before_forward=lambda: scales)
    for event in events:
        monitor_session.MonitorSession._note_forward_scale(session, event)
    assert scales == {"hot": expected}

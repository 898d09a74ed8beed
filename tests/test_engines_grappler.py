import gc
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_amp_plus import _compat
from keras_amp_plus._lists.precision_lists import PrecisionLists
from keras_amp_plus._report import precision_report
from keras_amp_plus.engines import GrapplerEngine
from keras_amp_plus.engines._grappler import (
    GRAPPLER_OPTION,
    LOG_PATH_VARIABLE,
    TOUCHED_VARIABLES,
)

DENY_ADD = "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_DENYLIST_ADD"
ALLOW_REMOVE = "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_ALLOWLIST_REMOVE"
ALLOW_ADD = "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_ALLOWLIST_ADD"

# The grappler bfloat16 rewrite needs oneDNN (see conftest.py).
pytestmark = pytest.mark.onednn


def _model(jit_compile=False):
    model = keras.Sequential(
        [
            keras.Input((6, 6, 2)),
            keras.layers.Conv2D(4, 3, name="conv"),
            keras.layers.Flatten(name="flatten"),
            keras.layers.Dense(8, name="d1"),
            keras.layers.Dense(2, name="d2"),
        ]
    )
    model.compile(optimizer="sgd", loss="mse", jit_compile=jit_compile)
    return model


def _fit_one_step(model):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 6, 6, 2)).astype("float32")
    y = rng.normal(size=(8, 2)).astype("float32")
    return model.fit(x, y, batch_size=8, epochs=1, verbose=0)


def _converted(model, engine):
    train = precision_report(model, engine)["graph"]["train"]
    return train["converted_by_op"], train["lists"], train["num_converted"]


@pytest.mark.parametrize(
    "lists",
    [PrecisionLists(deny_ops=("MatMul",)), PrecisionLists(deny_layers=("Dense",))],
    ids=["deny_ops", "deny_layers"],
)
def test_denying_matmul_changes_the_converted_nodes(lists, tmp_path):
    model = _model()
    engine = GrapplerEngine(log_dir=str(tmp_path))
    engine.apply(model, PrecisionLists())
    _fit_one_step(model)
    before, _, total_before = _converted(model, engine)
    # Two Dense layers: one forward MatMul and two gradient MatMuls each.
    assert before["MatMul"] == 6
    assert before["Conv2D"] == before["Conv2DBackpropFilter"] == 1

    if lists.deny_layers:
        # The Dense layers' BiasAdd is also the convolution's.
        with pytest.warns(
            UserWarning, match=r"in float32 too: conv \(BiasAdd, BiasAddGrad\)\."
        ):
            engine.apply(model, lists)
    else:
        engine.apply(model, lists)  # rebuilds the train function: no manual retrace
    history = _fit_one_step(model)
    after, paint_buckets, total_after = _converted(model, engine)
    assert "MatMul" not in after
    assert total_after <= total_before - 6
    assert after["Conv2D"] == after["Conv2DBackpropFilter"] == 1
    assert "MatMul" in paint_buckets["deny"]
    assert "MatMul" not in paint_buckets["allow"]
    assert np.isfinite(history.history["loss"][0])
    engine.restore()


@pytest.mark.parametrize("previous_option", [None, False, True])
def test_restore_puts_variables_and_option_back_exactly(
    previous_option, monkeypatch, tmp_path
):
    user_dir = tmp_path / "user"
    monkeypatch.setenv(DENY_ADD, "Pow")
    monkeypatch.setenv(LOG_PATH_VARIABLE, str(user_dir))
    monkeypatch.delenv(ALLOW_REMOVE, raising=False)
    if previous_option is None:
        _compat.reset_grappler_option(GRAPPLER_OPTION)
    else:
        tf.config.optimizer.set_experimental_options({GRAPPLER_OPTION: previous_option})
    environment = {name: os.environ.get(name) for name in TOUCHED_VARIABLES}
    options = tf.config.optimizer.get_experimental_options()

    engine = GrapplerEngine()
    engine.apply(_model(), PrecisionLists(deny_ops=("MatMul",)))
    assert os.environ[DENY_ADD] == "Pow,MatMul"  # the user's entry is kept
    assert os.environ[ALLOW_REMOVE] == "MatMul,Pow"  # each ADD paired with REMOVEs
    assert engine.dump_dir == os.path.join(str(user_dir), "apply_001")
    assert os.environ[LOG_PATH_VARIABLE] == engine.dump_dir
    assert tf.config.optimizer.get_experimental_options()[GRAPPLER_OPTION] is True

    engine.restore()
    assert {name: os.environ.get(name) for name in TOUCHED_VARIABLES} == environment
    assert tf.config.optimizer.get_experimental_options() == options
    engine.restore()  # a second restore changes nothing
    assert tf.config.optimizer.get_experimental_options() == options


@pytest.mark.parametrize("op_type", ["Mean", "MatMul"])
def test_the_users_own_add_is_paired_and_the_rewrite_still_runs(
    op_type, monkeypatch, tmp_path
):
    # Alone, an ADD leaves the op type in its default list too: grappler
    # then skips the whole rewrite ("Op lists have conflicting entries").
    monkeypatch.setenv(DENY_ADD, op_type)
    engine = GrapplerEngine(log_dir=str(tmp_path))
    model = _model()
    engine.apply(model, PrecisionLists(deny_ops=("Softmax",)))
    _fit_one_step(model)
    converted, lists, total = _converted(model, engine)
    engine.restore()
    assert total > 0 and converted["Conv2D"] == 1
    assert op_type in lists["deny"]
    assert ("MatMul" in converted) == (op_type != "MatMul")
    assert os.environ[DENY_ADD] == op_type


def test_a_misspelt_op_type_in_the_users_variables_is_said(monkeypatch, tmp_path):
    # Grappler ignores it (the user's placement is lost); custom and internal
    # op types are not in `tf.raw_ops` either: a warning, not a refusal.
    monkeypatch.setenv(DENY_ADD, "Matmul,_FusedMatMul")
    engine = GrapplerEngine(log_dir=str(tmp_path))
    with pytest.warns(UserWarning, match=r"'Matmul'.*Did you mean MatMul") as said:
        engine.apply(_model(), PrecisionLists())
    engine.restore()
    messages = [str(w.message) for w in said if "Grappler ignores" in str(w.message)]
    assert len(messages) == 1 and f"Received: {DENY_ADD}=('Matmul',)" in messages[0]


def test_bad_entries_raise_before_any_global_change(tmp_path):
    environment = {name: os.environ.get(name) for name in TOUCHED_VARIABLES}
    options = tf.config.optimizer.get_experimental_options()
    engine = GrapplerEngine(log_dir=str(tmp_path))
    with pytest.raises(ValueError, match=r"'dens' matches no layer.*Did you mean"):
        engine.apply(_model(), PrecisionLists(deny_layers=("dens",)))
    assert {name: os.environ.get(name) for name in TOUCHED_VARIABLES} == environment
    assert tf.config.optimizer.get_experimental_options() == options
    assert engine.dump_dir is None


@pytest.mark.parametrize(
    ("lists", "match"),
    [
        (
            PrecisionLists(deny_layers=("d2",), deny_ops=("Exp",)),
            r"cannot put these layers back into float32.*\['d2'\]",
        ),
        (PrecisionLists(deny_ops=("MatMul",)), "op lists would change nothing"),
    ],
    ids=["deny_layers", "deny_ops"],
)
def test_lists_a_mixed_model_ignores_raise_before_any_global_change(
    tmp_path, lists, match
):
    # The rewrite lowers float32 ops; a bfloat16 policy's layers stay
    # bfloat16 whatever the lists say (before, the denial passed silently).
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = _model()
    keras.config.set_dtype_policy("float32")
    environment = {name: os.environ.get(name) for name in TOUCHED_VARIABLES}
    options = tf.config.optimizer.get_experimental_options()
    engine = GrapplerEngine(log_dir=str(tmp_path))
    with pytest.raises(ValueError, match=match) as info:
        engine.apply(model, lists)
    assert "engine='keras'" in str(info.value) and "Received: " in str(info.value)
    assert {name: os.environ.get(name) for name in TOUCHED_VARIABLES} == environment
    assert tf.config.optimizer.get_experimental_options() == options
    # With a float32 output layer, op lists act on it: no error.
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = _model()
    keras.config.set_dtype_policy("float32")
    model.get_layer("d2").dtype_policy = keras.DTypePolicy("float32")
    engine.apply(model, PrecisionLists(deny_ops=("MatMul",)))
    engine.restore()


@pytest.mark.parametrize("order", ["first_applied_first", "last_applied_first"])
def test_two_engines_restored_in_any_order_leave_the_process_as_before(tmp_path, order):
    environment = {name: os.environ.get(name) for name in TOUCHED_VARIABLES}
    options = tf.config.optimizer.get_experimental_options()
    first = GrapplerEngine(log_dir=str(tmp_path / "first"))
    second = GrapplerEngine(log_dir=str(tmp_path / "second"))
    first.apply(_model(), PrecisionLists(deny_ops=("Exp",)))
    second.apply(_model(), PrecisionLists(allow_ops=("Exp",)))
    if order == "first_applied_first":
        first.restore()
        # The second engine is still on: its lists stay in force.
        assert os.environ.get(ALLOW_ADD) == "Exp"
        second.restore()
    else:
        second.restore()
        assert os.environ.get(DENY_ADD) == "Exp"  # the first engine's again
        first.restore()
    assert {name: os.environ.get(name) for name in TOUCHED_VARIABLES} == environment
    assert tf.config.optimizer.get_experimental_options() == options


def test_an_engine_applying_again_below_another_stays_in_force_until_restored(
    tmp_path,
):
    # AMPMonitor re-applies at an epoch end while another model's engine,
    # applied after it, is still on: its new lists must not be lost when the
    # other engine is restored, and each engine's lists start from the
    # user's own variables, not from the other engine's.
    environment = {name: os.environ.get(name) for name in TOUCHED_VARIABLES}
    first = GrapplerEngine(log_dir=str(tmp_path / "first"))
    second = GrapplerEngine(log_dir=str(tmp_path / "second"))
    model = _model()
    first.apply(model, PrecisionLists(deny_ops=("Exp",)))
    second.apply(_model(), PrecisionLists(allow_ops=("Tanh",)))
    assert os.environ.get(DENY_ADD) is None  # second's lists alone
    first.apply(model, PrecisionLists(deny_ops=("Exp", "Log")))
    assert os.environ.get(DENY_ADD) == "Exp,Log"
    assert os.environ.get(ALLOW_ADD) is None
    second.restore()
    assert os.environ.get(DENY_ADD) == "Exp,Log"
    first.restore()
    assert {name: os.environ.get(name) for name in TOUCHED_VARIABLES} == environment


def test_xla_compiled_models_get_a_warning(tmp_path):
    engine = GrapplerEngine(log_dir=str(tmp_path))
    with pytest.warns(UserWarning, match=r"jit_compile=True.*no effect"):
        engine.apply(_model(jit_compile=True), PrecisionLists())
    engine.restore()


def test_a_layer_without_op_types_gets_a_warning(tmp_path):
    engine = GrapplerEngine(log_dir=str(tmp_path))
    with pytest.warns(UserWarning, match=r"'flatten' \(Flatten\) has no op-type"):
        engine.apply(_model(), PrecisionLists(deny_layers=("flatten",)))
    # A regex that merely reaches Flatten is no mistake (a warning would fail
    # this test: the project's own warnings are errors under pytest).
    engine.apply(_model(), PrecisionLists(allow_layers=(".*",)))
    engine.restore()


def test_each_apply_dumps_into_a_fresh_directory(tmp_path):
    engine = GrapplerEngine(log_dir=str(tmp_path))
    model = _model()
    engine.apply(model, PrecisionLists())
    first = engine.dump_dir
    engine.apply(model, PrecisionLists(deny_ops=("Conv2D",)))
    assert engine.dump_dir != first
    assert sorted(os.listdir(tmp_path)) == ["apply_001", "apply_002"]
    engine.restore()


def test_the_same_lists_again_keep_the_optimized_function_and_its_dumps(tmp_path):
    # AMPMonitor applies its lists at the start of every `fit`: unchanged,
    # they must not make the step trace again (seconds on a large model).
    model = _model()
    engine = GrapplerEngine(log_dir=str(tmp_path))
    lists = PrecisionLists(deny_ops=("Conv2D",))
    engine.apply(model, lists)
    _fit_one_step(model)
    built, dump_dir = model.train_function, engine.dump_dir
    engine.apply(model, lists)
    assert model.train_function is built
    assert engine.dump_dir == dump_dir
    assert sorted(os.listdir(tmp_path)) == ["apply_001"]
    converted, _, _ = _converted(model, engine)
    assert converted["MatMul"] > 0 and "Conv2D" not in converted

    engine.apply(model, PrecisionLists(deny_ops=("MatMul",)))  # other lists
    assert model.train_function is not built
    engine.restore()
    restored = model.train_function
    # The restored function was not built under the lists: rebuilt again.
    engine.apply(model, PrecisionLists(deny_ops=("MatMul",)))
    assert model.train_function is not restored
    assert sorted(os.listdir(tmp_path)) == ["apply_001", "apply_002", "apply_003"]
    engine.restore()


class _ApplyAfterFirstEpoch(keras.callbacks.Callback):
    """What AMPMonitor does: change the lists between epochs, inside `fit`."""

    def __init__(self, engine, lists):
        super().__init__()
        self.engine, self.lists, self.functions = engine, lists, []

    def on_epoch_begin(self, epoch, logs=None):
        self.functions.append(self.model.train_function)

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            self.engine.apply(self.model, self.lists)


def test_apply_between_epochs_takes_effect_in_the_next_epoch(tmp_path):
    model = _model()
    engine = GrapplerEngine(log_dir=str(tmp_path))
    engine.apply(model, PrecisionLists())
    callback = _ApplyAfterFirstEpoch(engine, PrecisionLists(deny_ops=("MatMul",)))
    x = np.ones((8, 6, 6, 2), "float32")
    history = model.fit(x, np.ones((8, 2)), epochs=2, verbose=0, callbacks=[callback])
    first, second = callback.functions
    assert first is not second
    assert np.all(np.isfinite(history.history["loss"]))
    epoch_1 = precision_report(model, engine, log_dir=str(tmp_path / "apply_001"))
    epoch_2 = precision_report(model, engine)
    assert epoch_1["graph"]["train"]["converted_by_op"]["MatMul"] == 6
    assert "MatMul" not in epoch_2["graph"]["train"]["converted_by_op"]
    engine.restore()


def _global_state():
    environment = {name: os.environ.get(name) for name in TOUCHED_VARIABLES}
    return environment, tf.config.optimizer.get_experimental_options()


def test_an_unusable_log_dir_raises_before_any_global_change(tmp_path):
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("")
    before = _global_state()
    engine = GrapplerEngine(log_dir=str(not_a_directory))
    with pytest.raises(ValueError) as info:
        engine.apply(_model(), PrecisionLists(deny_ops=("MatMul",)))
    assert "cannot create its graph-dump directory" in str(info.value)
    assert f"Received: log_dir={str(not_a_directory)!r}" in str(info.value)
    assert _global_state() == before
    assert engine.dump_dir is None


class _TestFunctionFails(keras.Sequential):
    """A model whose test function cannot be rebuilt (fails after the env change)."""

    fail = False

    def make_test_function(self, force=False):
        if self.fail:
            raise RuntimeError("cannot rebuild the test function")
        return super().make_test_function(force)


def test_a_failing_apply_puts_the_global_state_back(tmp_path):
    model = _TestFunctionFails([keras.Input((4,)), keras.layers.Dense(2)], name="m")
    model.compile(optimizer="sgd", loss="mse")
    model.evaluate(np.ones((4, 4)), np.ones((4, 2)), verbose=0)  # a test function
    original = _global_state()
    engine = GrapplerEngine(log_dir=str(tmp_path))
    model.fail = True
    with pytest.raises(RuntimeError, match="cannot rebuild"):
        engine.apply(model, PrecisionLists(deny_ops=("MatMul",)))
    assert _global_state() == original
    engine.restore()  # nothing was applied: nothing to restore
    assert _global_state() == original

    model.fail = False
    engine.apply(model, PrecisionLists(deny_ops=("MatMul",)))
    applied, first_dump = _global_state(), engine.dump_dir
    model.fail = True
    with pytest.raises(RuntimeError, match="cannot rebuild"):
        engine.apply(model, PrecisionLists(deny_ops=("Conv2D",)))
    assert _global_state() == applied  # back to the last successful apply
    assert engine.dump_dir == first_dump
    model.fail = False
    engine.restore()
    assert _global_state() == original


def test_a_reused_log_dir_never_mixes_runs(tmp_path):
    model = _model()
    first = GrapplerEngine(log_dir=str(tmp_path))
    first.apply(model, PrecisionLists())
    _fit_one_step(model)
    first.restore()
    assert precision_report(model, first)["graph"]["train"]["num_converted"] > 0

    # A second run in the same directory: its dumps go to a new subdirectory,
    # and a train function whose rewrite converts nothing reads as 0, not as
    # the first run's counts.
    model = _model()
    second = GrapplerEngine(log_dir=str(tmp_path))
    everything = ("MatMul", "Conv2D", "Conv2DBackpropFilter", "Conv2DBackpropInput")
    second.apply(model, PrecisionLists(deny_ops=everything))
    _fit_one_step(model)
    assert second.dump_dir == str(tmp_path / "apply_002")
    train = precision_report(model, second)["graph"]["train"]
    assert train["is_train"] is True
    assert train["num_converted"] == 0 and train["converted_by_op"] == {}
    second.restore()


def test_an_own_temporary_dump_dir_is_pruned_and_deleted(monkeypatch):
    monkeypatch.delenv(LOG_PATH_VARIABLE, raising=False)
    model = _model()
    engine = GrapplerEngine()
    for deny in ("MatMul", "Conv2D", "BiasAdd"):
        engine.apply(model, PrecisionLists(deny_ops=(deny,)))
    log_dir = engine.log_dir
    assert sorted(os.listdir(log_dir)) == ["apply_002", "apply_003"]
    engine.restore()
    del engine
    gc.collect()
    # The model keeps its last engine (and so the dumps) for precision_report.
    assert os.path.isdir(log_dir)
    del model
    gc.collect()
    assert not os.path.exists(log_dir)


def test_a_fit_stopped_by_an_error_in_a_step_leaves_no_rewrite_on(tmp_path):
    from keras_amp_plus.callbacks import AMPMonitor

    model = _model()
    before = _global_state()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 6, 6, 2)).astype("float32")
    y = rng.normal(size=(8, 2)).astype("float32")

    def batches():
        yield x, y
        raise RuntimeError("a broken record")

    signature = (
        tf.TensorSpec((8, 6, 6, 2), tf.float32),
        tf.TensorSpec((8, 2), tf.float32),
    )
    data = tf.data.Dataset.from_generator(batches, output_signature=signature)
    monitor = AMPMonitor(str(tmp_path), engine="grappler")
    # Keras calls no `on_train_end` when `fit` raises.
    with pytest.raises(Exception, match="a broken record"):
        model.fit(data, epochs=1, shuffle=False, verbose=0, callbacks=[monitor])
    assert _global_state() == before
    # The model trains without the monitor's step, its events were flushed,
    # and the monitor runs again in a later `fit`.
    assert "amp" in os.listdir(tmp_path)
    assert np.isfinite(_fit_one_step(model).history["loss"][0])
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[monitor])
    assert _global_state() == before


def test_a_read_that_fails_mid_epoch_leaves_no_rewrite_on(tmp_path, monkeypatch):
    # A read between steps (say, the log's disk is full) stops `fit` with no
    # `on_train_end` either.
    from keras_amp_plus.callbacks import AMPMonitor, _monitor_session

    model = _model()
    before = _global_state()

    def full_disk(self, *args, **kwargs):
        raise OSError(28, "No space left on device")

    monitor = AMPMonitor(str(tmp_path), engine="grappler", read_every_steps=1)
    monkeypatch.setattr(_monitor_session.MonitorSession, "drain", full_disk)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 6, 6, 2)).astype("float32")
    y = rng.normal(size=(16, 2)).astype("float32")
    with pytest.raises(OSError, match="No space left"):
        model.fit(x, y, batch_size=8, verbose=0, callbacks=[monitor])
    assert _global_state() == before
    assert "train_step" not in model.__dict__  # the model's own step again
    monkeypatch.undo()
    model.fit(x, y, batch_size=8, verbose=0, callbacks=[monitor])
    assert _global_state() == before

"""ITEX's Advanced AMP driven by AMPMonitor / ItexEngine (the ITEX stack only).

A float32 transformer block trains with `AMPMonitor(engine="itex")`; what ITEX
converted is read from the graphs it dumps into
`ITEX_AUTO_MIXED_PRECISION_LOG_PATH` (see `keras_amp_plus.engines._itex_log`).
"""

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf

import keras_amp_plus as kap
from keras_amp_plus import _compat, _hardware
from keras_amp_plus import _itex_probe as itex_probe
from keras_amp_plus._lists.precision_lists import PrecisionLists
from keras_amp_plus.engines import ItexEngine
from keras_amp_plus.engines import _itex_log as itex_log

pytestmark = pytest.mark.itex

# The op types a Dense / attention matmul becomes on ITEX's CPU graph.
DENSE_MATMULS = ("MatMul", "_ITEXFusedMatMul", "_ITEXFusedMatMulGrad")
ATTENTION_MATMULS = ("Einsum", "BatchMatMulV2", "_ITEXFusedBatchMatMulV2")


def transformer(d=32, sequence=8, features=16, classes=4):
    """Return a compiled float32 transformer block (attention + MLP)."""
    keras.utils.set_random_seed(0)
    inputs = keras.Input((sequence, features))
    x = keras.layers.Dense(d, name="embed")(inputs)
    attention = keras.layers.MultiHeadAttention(2, d // 2, name="attention")(x, x)
    x = kap.layers.LayerNormalization(name="ln1")(x + attention)
    h = keras.layers.Dense(2 * d, name="ffn_in")(x)
    h = kap.layers.Swish(name="swish")(h)
    h = keras.layers.Dense(d, name="ffn_out")(h)
    x = kap.layers.LayerNormalization(name="ln2")(x + h)
    pooled = keras.layers.GlobalAveragePooling1D()(x)
    outputs = keras.layers.Dense(classes, name="head")(pooled)
    model = keras.Model(inputs, outputs)
    model.compile(
        keras.optimizers.Adam(1e-3),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    return model


def data(samples=32, sequence=8, features=16, classes=4):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, sequence, features)).astype("float32")
    return x, rng.integers(0, classes, size=(samples,))


def converted(records, op_types):
    return sum(record["converted"][op] for record in records for op in op_types)


@pytest.fixture
def itex_log_dir(tmp_path, monkeypatch):
    """ITEX dumps every rewrite here (it reads the variable at each rewrite)."""
    path = tmp_path / "itex_amp_log"
    path.mkdir()
    monkeypatch.setenv(itex_log.LOG_PATH_ENV, str(path))
    return str(path)


def amp_options():
    config = _compat.itex_module().get_config()
    return config.graph_options


def fit_transformer_with_itex_monitor(tmp_path):
    """Fit `transformer()` one epoch with AMPMonitor(engine="itex").

    Returns a function that fits it one more epoch with the same monitor.
    """
    model = transformer()
    x, y = data()
    monitor = kap.callbacks.AMPMonitor(str(tmp_path / "logs"), engine="itex")

    def fit():
        model.fit(x, y, batch_size=16, epochs=1, verbose=0, callbacks=[monitor])

    fit()
    return fit


@pytest.mark.itex_bfloat16
def test_amp_monitor_turns_advanced_amp_on_and_matmuls_run_in_bfloat16(
    itex_log_dir, tmp_path
):
    itex = _compat.itex_module()
    before = itex.get_config().SerializeToString()
    fit_transformer_with_itex_monitor(tmp_path)

    records = itex_log.read_rewrites(itex_log_dir)
    assert records, "ITEX rewrote nothing: Advanced AMP was not on"
    assert converted(records, DENSE_MATMULS) >= 4  # embed, ffn_in, ffn_out, head
    assert converted(records, ATTENTION_MATMULS) >= 2
    # Our LayerNormalization runs ITEX's fused kernel, converted with its
    # statistics and gamma/beta (type U) still float32.
    assert converted(records, ("ITEXLayerNorm",)) == 2
    for dump in os.listdir(itex_log_dir):
        if dump.startswith("graphdef_AutoMixedPrecision_") and dump.endswith(".pb"):
            graph = tf.compat.v1.GraphDef()
            with open(os.path.join(itex_log_dir, dump), "rb") as f:
                graph.ParseFromString(f.read())
            for node in graph.node:
                if node.op in ("ITEXLayerNorm", "ITEXLayerNormGrad"):
                    assert node.attr["U"].type == tf.float32.as_datatype_enum
    # The final lists are consistent, and the config is put back after fit.
    assert all(not itex_log.conflicting_ops(r["lists"]) for r in records)
    assert itex.get_config().SerializeToString() == before


@pytest.mark.itex_bfloat16
def test_a_second_fit_with_the_same_lists_reuses_the_rewritten_step(
    itex_log_dir, tmp_path
):
    itex = _compat.itex_module()
    before = itex.get_config().SerializeToString()
    fit_again = fit_transformer_with_itex_monitor(tmp_path)
    first = itex_log.read_rewrites(itex_log_dir)
    # A retrace would dump new rewrites; a kept step must not be reported as
    # a rewrite that did not happen (warnings are errors in this suite).
    fit_again()
    assert converted(first, DENSE_MATMULS) >= 4
    assert len(itex_log.read_rewrites(itex_log_dir)) == len(first)
    assert itex.get_config().SerializeToString() == before


@pytest.mark.itex_bfloat16
def test_moving_matmul_to_the_deny_list_changes_the_graph_after_retrace(
    itex_log_dir, tmp_path
):
    model = transformer()
    x, y = data()
    fit_args = dict(batch_size=16, epochs=1, verbose=0)
    model.fit(
        x,
        y,
        callbacks=[kap.callbacks.AMPMonitor(str(tmp_path / "a"), engine="itex")],
        **fit_args,
    )
    first = itex_log.read_rewrites(itex_log_dir)
    assert converted(first, DENSE_MATMULS) > 0

    denied = PrecisionLists(deny_ops=("MatMul",))
    monitor = kap.callbacks.AMPMonitor(str(tmp_path / "b"), engine="itex", lists=denied)
    model.fit(x, y, callbacks=[monitor], **fit_args)
    second = itex_log.read_rewrites(itex_log_dir, since=len(first))
    assert second, "the train function was not retraced after the list change"
    # MatMul and ITEX's fused MatMuls stay float32; attention still converts.
    assert converted(second, DENSE_MATMULS) == 0
    assert converted(second, ATTENTION_MATMULS) > 0
    for record in second:
        assert {"MatMul", "_ITEXFusedMatMul"} <= record["lists"]["deny"]
        assert not record["lists"]["allow"] & {"MatMul", "_ITEXFusedMatMul"}


@pytest.mark.itex_bfloat16
def test_the_users_conflicting_config_is_made_consistent(itex_log_dir):
    itex = _compat.itex_module()
    model = transformer()
    x, y = data()
    # The user's own config adds MatMul to the deny list without removing it
    # from ITEX's default allow list: ITEX then skips its whole pass.
    config = itex.get_config()
    options = config.graph_options
    options.auto_mixed_precision_options.denylist_add = "MatMul"
    options.auto_mixed_precision = itex.ON
    itex.set_config(config)
    model.make_train_function(force=True)
    model.train_on_batch(x[:16], y[:16])
    assert itex_log.count_rewrites(itex_log_dir) == 0  # silently float32

    engine = ItexEngine()
    engine.apply(model, PrecisionLists())  # starts from the user's config
    model.train_on_batch(x[:16], y[:16])
    records = engine.check_rewrites()
    assert records, "the pass still failed"
    # The user's deny of "MatMul" is kept (their config names no fused ops).
    assert converted(records, ("MatMul",)) == 0
    assert converted(records, ATTENTION_MATMULS) > 0
    fields = amp_options().auto_mixed_precision_options
    assert "MatMul" in fields.allowlist_remove.split(",")
    engine.restore()
    assert amp_options().auto_mixed_precision_options.denylist_add == "MatMul"


@pytest.mark.itex_bfloat16
def test_a_conflict_made_behind_the_engines_back_is_noticed(itex_log_dir):
    itex = _compat.itex_module()
    model = transformer()
    x, y = data()
    engine = ItexEngine()
    engine.apply(model, PrecisionLists())
    config = itex.get_config()
    config.graph_options.auto_mixed_precision_options.inferlist_add = "MatMul"
    itex.set_config(config)  # MatMul now in the allow and the infer list
    model.make_train_function(force=True)
    model.train_on_batch(x[:16], y[:16])
    with pytest.warns(UserWarning, match="did not rewrite"):
        assert engine.check_rewrites() == []
    engine.restore()


def test_default_data_type_and_the_fields_set():
    itex = _compat.itex_module()
    engine = ItexEngine()
    assert engine.data_type == "BFLOAT16"  # no XPU on CI machines
    model = transformer()
    # ffn_out's MatMul is every Dense layer's: the engine says so.
    with pytest.warns(UserWarning, match=r"in float32 too: .*ffn_in \(MatMul"):
        engine.apply(model, PrecisionLists(deny_layers=("ffn_out",)))
    options = amp_options()
    assert options.auto_mixed_precision == itex.ON
    amp = options.auto_mixed_precision_options
    assert amp.data_type == itex.BFLOAT16
    deny = amp.denylist_add.split(",")
    assert {"MatMul", "_ITEXFusedMatMul", "_ITEXFusedMatMulGrad"} <= set(deny)
    for other in ("allowlist_remove", "inferlist_remove", "clearlist_remove"):
        assert set(deny) <= set(getattr(amp, other).split(","))
    engine.restore()
    assert amp_options().auto_mixed_precision != itex.ON


@pytest.mark.parametrize("order", ["first_applied_first", "last_applied_first"])
def test_two_engines_restored_in_any_order_leave_the_config_as_before(order):
    # Two models, each with its own engine: ITEX's config is process-global.
    original = amp_options().SerializeToString(deterministic=True)
    first, second = ItexEngine(), ItexEngine()
    first.apply(transformer(), PrecisionLists(deny_ops=("Tanh",)))
    second.apply(transformer(), PrecisionLists(allow_ops=("Tanh",)))
    amp = amp_options().auto_mixed_precision_options
    assert "Tanh" in amp.allowlist_add.split(",")
    assert "Tanh" not in amp.denylist_add.split(",")  # not first's lists too
    if order == "first_applied_first":
        first.restore()
        amp = amp_options().auto_mixed_precision_options
        assert "Tanh" in amp.allowlist_add.split(",")  # second's, still on
        second.restore()
    else:
        second.restore()
        amp = amp_options().auto_mixed_precision_options
        assert "Tanh" in amp.denylist_add.split(",")  # first's again
        first.restore()
    assert amp_options().SerializeToString(deterministic=True) == original


def test_engine_refuses_before_the_first_step_when_bfloat16_kernels_abort(
    tmp_path, monkeypatch
):
    # On ITEX's AVX2 backend the first bfloat16 MatMul aborts the process; the
    # probe's answer (here: a cached "no") must stop fit before any step.
    monkeypatch.setenv(_hardware.CACHE_DIR_VARIABLE, str(tmp_path / "cache"))
    os.makedirs(tmp_path / "cache")
    with open(itex_probe._cache_file(), "w") as f:
        json.dump(
            {
                "works": False,
                "backend": "AVX2",
                "reason": "a bfloat16 MatMul under ITEX killed the process "
                "(signal 6) on its AVX2 CPU backend",
            },
            f,
        )
    itex_probe.itex_bfloat16_status.cache_clear()
    itex = _compat.itex_module()
    before = itex.get_config().SerializeToString()
    model = transformer()
    weights = [w.copy() for w in model.get_weights()]
    x, y = data()
    try:
        with pytest.raises(RuntimeError) as info:
            model.fit(
                x,
                y,
                epochs=1,
                verbose=0,
                callbacks=[kap.callbacks.AMPMonitor(None, engine="itex")],
            )
    finally:
        itex_probe.itex_bfloat16_status.cache_clear()
    message = str(info.value)
    assert "killed the process (signal 6)" in message
    assert "engine='keras'" in message and "float32" in message
    assert "Received: engine='itex', itex_backend='AVX2'" in message
    assert int(model.optimizer.iterations.numpy()) == 0
    for before_weight, after in zip(weights, model.get_weights(), strict=True):
        np.testing.assert_array_equal(before_weight, after)
    assert itex.get_config().SerializeToString() == before


class ConflictingConfig(keras.callbacks.Callback):
    """Puts MatMul into ITEX's infer list too, behind AMPMonitor's back."""

    def on_epoch_begin(self, epoch, logs=None):
        itex = _compat.itex_module()
        config = itex.get_config()
        config.graph_options.auto_mixed_precision_options.inferlist_add = "MatMul"
        itex.set_config(config)
        self.model.make_train_function(force=True)


@pytest.mark.itex_bfloat16
def test_amp_monitor_notices_a_rewrite_that_did_not_happen(itex_log_dir):
    model = transformer()
    x, y = data()
    monitor = kap.callbacks.AMPMonitor(None, engine="itex")
    with pytest.warns(UserWarning, match="ITEX did not rewrite"):
        model.fit(
            x,
            y,
            batch_size=16,
            epochs=1,
            verbose=0,
            callbacks=[monitor, ConflictingConfig()],
        )
    assert itex_log.count_rewrites(itex_log_dir) == 0


@pytest.mark.itex_bfloat16
def test_a_fit_stopped_by_an_error_in_a_step_puts_the_config_back(tmp_path):
    itex = _compat.itex_module()
    before = itex.get_config().SerializeToString()
    model = transformer()
    x, y = data()

    def batches():
        yield x[:16], y[:16]
        raise RuntimeError("a broken record")

    signature = (
        tf.TensorSpec((16, *x.shape[1:]), tf.float32),
        tf.TensorSpec((16,), tf.int64),
    )
    stream = tf.data.Dataset.from_generator(batches, output_signature=signature)
    monitor = kap.callbacks.AMPMonitor(str(tmp_path), engine="itex")
    # Keras calls no `on_train_end` when `fit` raises.
    with pytest.raises(Exception, match="a broken record"):
        model.fit(stream, epochs=1, verbose=0, callbacks=[monitor])
    assert itex.get_config().SerializeToString() == before


@pytest.mark.itex_bfloat16
def test_precision_report_reads_itex_dumps(itex_log_dir, tmp_path):
    fit_transformer_with_itex_monitor(tmp_path)
    model = transformer()  # the report reads the dumps of the fit above
    report = kap.precision_report(model, "itex", log_dir=itex_log_dir)
    train = report["graph"]["train"]
    assert train is not None and train["function"].startswith("graph ")
    # Its matmuls, forward and backward, ran in bfloat16.
    converted_matmuls = sum(train["converted_by_op"].get(op, 0) for op in DENSE_MATMULS)
    assert converted_matmuls >= 4


def test_precision_report_says_itex_dumps_only_where_its_variable_is_set(
    monkeypatch,
):
    monkeypatch.delenv(itex_log.LOG_PATH_ENV, raising=False)
    with pytest.raises(ValueError, match="ITEX dumps its rewrite only where"):
        kap.precision_report(transformer(), ItexEngine())


def test_keras_2_reads_jit_compile_auto_as_xla_on():
    # Keras 2 keeps the string and compiles with XLA for any true value: the
    # monitor's and the scaler's checks of a strategy must see it as on.
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile("sgd", "mse", jit_compile="auto")
    assert _compat.jit_compile_on(model)
    model.compile("sgd", "mse")
    assert not _compat.jit_compile_on(model)
    assert "'auto' too, as XLA on" in _compat.JIT_COMPILE_OFF_ADVICE


@pytest.mark.itex_bfloat16
def test_a_mixed_float16_model_under_the_op_engine_is_told_why_denials_fail(
    tmp_path, caplog
):
    # Op lists cannot change what a Keras float16 policy computes: said
    # before the first step, and again when the denied layer still overflows
    # (not "not finite in float32 either": it is finite there).
    _compat.set_global_policy("mixed_float16")
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(
        16, name="hot", kernel_initializer=keras.initializers.Constant(3e4)
    )(inputs)
    hidden = kap.layers.LayerNormalization(name="ln")(hidden)
    outputs = keras.layers.Dense(1, dtype="float32", name="out")(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(kap.optimizers.LossScaleOptimizer(keras.optimizers.Adam()), "mse")
    x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
    monitor = kap.callbacks.AMPMonitor(str(tmp_path), engine="itex")
    with caplog.at_level("WARNING", logger="keras_amp_plus"):
        model.fit(
            x,
            np.zeros((32, 1)),
            batch_size=16,
            epochs=2,
            verbose=0,
            callbacks=[monitor],
        )
    assert "engine='itex' moves op types between lists" in caplog.text
    assert "'hot'" in caplog.text.split("moves op types")[1].split("\n")[0]
    assert "which the engine's op lists cannot change" in caplog.text
    assert "not finite in float32 either" not in caplog.text


@pytest.mark.itex_bfloat16
def test_a_layer_built_in_float32_stays_there_when_allowed_on_keras_2(caplog):
    # Keras 2 casts only the AutoCastVariables a layer built under a mixed
    # policy made: a float32-built Conv2D moved to 16 bits failed its first
    # step. It stays in float32 and the reason is said; our LayerNormalization,
    # which casts its weights itself, moves.
    keras.utils.set_random_seed(0)
    inputs = keras.Input((8, 8, 3))
    hidden = keras.layers.Conv2D(4, 3, name="conv")(inputs)
    hidden = kap.layers.LayerNormalization(name="ln")(hidden)
    outputs = keras.layers.Dense(1, name="out")(
        keras.layers.GlobalAveragePooling2D()(hidden)
    )
    model = keras.Model(inputs, outputs)
    model.compile("sgd", "mse")
    lists = PrecisionLists(allow_layers=("conv", "ln"))
    x = np.random.default_rng(0).normal(size=(16, 8, 8, 3)).astype("float32")
    y = np.zeros((16, 1), "float32")
    with caplog.at_level("WARNING", logger="keras_amp_plus"):
        history = model.fit(
            x, y, epochs=1, verbose=0, callbacks=[kap.AMPMonitor(None, lists=lists)]
        )
    assert np.isfinite(history.history["loss"][0])
    assert model.get_layer("conv").compute_dtype == "float32"
    assert model.get_layer("ln").compute_dtype == "bfloat16"
    said = [m for m in caplog.messages if "stays in float32" in m]
    assert len(said) == 1 and "'conv'" in said[0]


def test_keras_2_layers_that_skip_autocasting_move_back_to_16_bits(caplog):
    # Keras 2's normalizations and Embedding keep plain float32 weights
    # under a mixed policy by design: denied and allowed back, they compute
    # in 16 bits again, without the warning for float32-built layers.
    keras.mixed_precision.set_global_policy("mixed_float16")
    inputs = keras.Input((6,), dtype="int32")
    hidden = keras.layers.Embedding(10, 4, name="emb")(inputs)
    hidden = keras.layers.BatchNormalization(name="bn")(hidden)
    hidden = keras.layers.LayerNormalization(name="ln")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(1, name="out")(hidden))
    engine = kap.engines.KerasEngine()
    names = ("emb", "bn", "ln")
    with caplog.at_level("WARNING", logger="keras_amp_plus"):
        engine.apply(model, PrecisionLists(deny_layers=names))
        assert {model.get_layer(n).compute_dtype for n in names} == {"float32"}
        engine.apply(model, PrecisionLists(allow_layers=names))
    assert {model.get_layer(n).compute_dtype for n in names} == {"float16"}
    assert not [m for m in caplog.messages if "stays in float32" in m]
    outputs = model(np.arange(12).reshape(2, 6) % 10, training=True)
    assert np.isfinite(np.asarray(outputs, "float32")).all()


@pytest.mark.parametrize("residual", ["plus", "add_layer", "relu", "relu_then_plus"])
def test_a_layer_feeding_a_keras_2_op_layer_keeps_its_precision(
    residual, tmp_path, caplog
):
    # Keras 2 makes `h + r` a TFOpLambda that casts no inputs: `embed` in
    # float32 beside float16 `res` failed the next step and left the model
    # unable to predict. It stays in float16 and the fix is said; written
    # as `keras.layers.Add()`, which casts, the denial takes effect.
    keras.mixed_precision.set_global_policy("mixed_float16")
    inputs = keras.Input((8,))
    hidden = keras.layers.Dense(16, name="embed")(inputs)
    skipped = keras.layers.Dense(16, name="res")(hidden)
    if residual == "plus":
        hidden = hidden + skipped
    elif residual == "add_layer":
        hidden = keras.layers.Add()([hidden, skipped])
    elif residual == "relu":  # an op layer of one input mixes no dtypes
        hidden = tf.nn.relu(hidden)
    else:  # but hands its input's dtype on to the `+` after it
        hidden = tf.nn.relu(hidden) + skipped
    outputs = keras.layers.Dense(2, dtype="float32", name="head")(hidden)
    model = keras.Model(inputs, outputs)
    model.compile(
        kap.optimizers.LossScaleOptimizer(keras.optimizers.Adam()),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
    x[:, 0] = 7e4  # beyond float16's range: `embed` overflows
    y = np.zeros(64, "int64")
    monitor = kap.AMPMonitor(str(tmp_path))
    with caplog.at_level("WARNING", logger="keras_amp_plus"):
        history = model.fit(
            x, y, epochs=2, batch_size=32, verbose=0, callbacks=[monitor]
        ).history
    # (`Add` may follow: its cast of `embed`'s float32 outputs can overflow.)
    assert monitor.lists.deny_layers[0] == "embed"
    said = [m for m in caplog.messages if "cast no inputs" in m]
    if "plus" in residual:
        assert model.get_layer("embed").compute_dtype == "float16"
        assert len(said) == 1 and "'tf.__operators__.add'" in said[0]
        assert "keras.layers.Add()" in said[0]
    else:
        assert model.get_layer("embed").compute_dtype == "float32"
        assert not said
    if residual == "relu":  # (after `Add`, its own cast overflows next)
        assert np.isfinite(history["loss"][-1])
    assert model.predict(x[:4], verbose=0).shape == (4, 2)


def test_keras_2_accuracies_of_skipped_epochs_and_nan_outputs_read_minus_inf(tmp_path):
    # Keras 2's metrics carry no direction; its callbacks guess it from the
    # name ("accuracy": up). Every step of epoch 0 overflows in `embed`, and
    # its validation runs on NaN outputs (argmax 0, these labels: 1.0).
    keras.mixed_precision.set_global_policy("mixed_float16")
    model = keras.Sequential(
        [
            keras.Input((8,)),
            keras.layers.Dense(16, name="embed"),
            keras.layers.Dense(2, dtype="float32", name="head"),
        ]
    )
    model.compile(
        kap.optimizers.LossScaleOptimizer(keras.optimizers.Adam()),
        keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=[
            "accuracy",
            keras.metrics.SparseCategoricalAccuracy(name="sparse_acc"),
            # The callbacks disagree on this name ("acc" in it, no "acc" end).
            keras.metrics.SparseCategoricalAccuracy(name="acc_of_top"),
        ],
    )
    x = np.random.default_rng(0).normal(size=(64, 8)).astype("float32")
    x[:, 0] = 7e4
    y = np.zeros(64, "int64")
    checkpoint = keras.callbacks.ModelCheckpoint(
        str(tmp_path / "best.keras"), monitor="val_accuracy", save_best_only=True
    )
    history = model.fit(
        x,
        y,
        epochs=2,
        batch_size=32,
        verbose=0,
        validation_data=(x, y),
        callbacks=[kap.AMPMonitor(str(tmp_path)), checkpoint],
    ).history
    assert history["loss"][0] == history["val_loss"][0] == np.inf
    for name in ("accuracy", "sparse_acc", "val_accuracy", "val_sparse_acc"):
        assert history[name][0] == -np.inf and np.isfinite(history[name][1])
    # Never the best of a Keras 2 callback, whatever its mode.
    disagreed = history["val_acc_of_top"]
    assert np.isnan(disagreed[0]) and np.isfinite(disagreed[1])
    assert checkpoint.best == history["val_accuracy"][1]

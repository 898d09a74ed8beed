import os
import re

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_amp_plus._lists.precision_lists import PrecisionLists
from keras_amp_plus._report import precision_report, read_rewrite_dump
from keras_amp_plus.engines import GrapplerEngine, KerasEngine
from keras_amp_plus.engines._grappler import (
    GRAPPLER_OPTION,
    LOG_PATH_VARIABLE,
)

DENY_ADD = "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_DENYLIST_ADD"
ALLOW_REMOVE = "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_ALLOWLIST_REMOVE"


def _model():
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(4, name="d1"),
            keras.layers.LayerNormalization(name="ln"),
            keras.layers.Dense(2, name="d2"),
        ]
    )


def _run_rewritten(dump_dir, function):
    """Trace and run `function` once with the bf16 rewrite dumping to dump_dir."""
    dump_dir.mkdir()  # grappler does not create it
    os.environ[LOG_PATH_VARIABLE] = str(dump_dir)
    tf.config.optimizer.set_experimental_options({GRAPPLER_OPTION: True})
    function(tf.ones((4, 8)), tf.ones((8, 3)))
    return read_rewrite_dump(str(dump_dir))


@pytest.mark.parametrize("policy", ["float32", "mixed_float16", "mixed_bfloat16"])
def test_keras_report_lists_each_layers_compute_dtype(policy):
    keras.config.set_dtype_policy(policy)
    model = _model()
    KerasEngine().apply(model, PrecisionLists(deny_layers=("ln",)))
    report = precision_report(model, "keras")
    low = {"float32": "float32", "mixed_float16": "float16"}.get(policy, "bfloat16")
    rows = {row["name"]: row for row in report["layers"]}
    assert rows["ln"]["compute_dtype"] == "float32"
    assert rows["ln"]["low_precision"] is False
    assert rows["d1"]["compute_dtype"] == rows["d2"]["compute_dtype"] == low
    assert rows["d1"]["variable_dtype"] == "float32"
    assert rows["d1"]["class_name"] == "Dense"
    assert report["num_layers"] == 3
    assert report["num_low_precision_layers"] == (0 if policy == "float32" else 2)
    assert report["engine"] == "keras" and "graph" not in report


def test_nested_models_count_their_layers_not_themselves():
    keras.config.set_dtype_policy("mixed_bfloat16")
    inner = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4, name="a")], name="inner"
    )
    model = keras.Sequential([keras.Input((4,)), inner, _model()], name="outer")
    report = precision_report(model, "keras")
    names = [row["name"] for row in report["layers"]]
    assert sorted(names) == ["a", "d1", "d2", "ln"]
    assert report["num_low_precision_layers"] == 4


def test_layers_without_weights_are_named_by_their_chain():
    # Keras's `layer.path` is None for them; the table names every layer as the
    # lists and the monitor do, two Dropouts in two nested models apart.
    def block(name):
        inputs = keras.Input((4,))
        outputs = keras.layers.Dropout(0.1, name="drop")(keras.layers.Dense(4)(inputs))
        return keras.Model(inputs, outputs, name=name)

    model = keras.Sequential([keras.Input((4,)), block("a"), block("b")], name="m")
    report = precision_report(model, "keras")
    chains = [
        row["chain"] for row in report["layers"] if row["class_name"] == "Dropout"
    ]
    assert chains == ["a/drop", "b/drop"]
    assert "None" not in str(report) and "None" not in report.to_markdown()
    assert "a/drop" in str(report) and "b/drop" in report.to_markdown()


def test_a_layer_time_distributed_runs_reports_the_dtype_it_computes_in():
    # Keras 3's TimeDistributed runs its layer under the wrapper's policy:
    # the float32 Dense inside computes in bfloat16, and the report says so.
    keras.config.set_dtype_policy("mixed_bfloat16")
    dense = keras.layers.Dense(4, dtype="float32", name="d")
    model = keras.Sequential(
        [keras.Input((3, 4)), keras.layers.TimeDistributed(dense, name="td")]
    )
    assert model(np.ones((1, 3, 4), "float32")).dtype == "bfloat16"
    rows = {row["chain"]: row for row in precision_report(model, "keras")["layers"]}
    assert rows["td/d"]["compute_dtype"] == "bfloat16"
    assert rows["td/d"]["low_precision"]


@pytest.mark.onednn
def test_graph_counts_match_a_known_function(tmp_path):
    @tf.function
    def matmul_relu(x, w):
        return tf.nn.relu(tf.matmul(x, w))

    dump = _run_rewritten(tmp_path / "on", matmul_relu)
    (record,) = dump["functions"]
    assert record["converted_by_op"] == {"MatMul": 1, "Relu": 1}
    # x and w cast to bfloat16, the result cast back to float32.
    assert record["num_casts_inserted"] == 3
    assert record["num_converted"] == 2
    assert record["is_train"] is False and dump["train"] is None
    assert "MatMul" in record["lists"]["allow"]

    os.environ[DENY_ADD] = "MatMul"
    os.environ[ALLOW_REMOVE] = "MatMul"
    matmul_relu = tf.function(matmul_relu.python_function)  # a fresh trace
    # Optimized but nothing converted: only the `preop` graph is written, and
    # the function is still reported, with zero converted nodes.
    (record,) = _run_rewritten(tmp_path / "deny", matmul_relu)["functions"]
    assert "graphdef_preop_" in record["file"]
    assert record["num_converted"] == record["num_casts_inserted"] == 0
    assert record["converted_by_op"] == {} and record["lists"] == {}


@pytest.mark.onednn
def test_nodes_already_in_bfloat16_are_not_counted(tmp_path):
    @tf.function
    def half_converted(x, w):
        low = tf.matmul(tf.cast(x, tf.bfloat16), tf.cast(w, tf.bfloat16))
        return tf.matmul(x, w) + tf.cast(low, tf.float32)

    (record,) = _run_rewritten(tmp_path / "dump", half_converted)["functions"]
    assert record["converted_by_op"] == {"AddV2": 1, "MatMul": 1}


@pytest.mark.onednn
def test_report_follows_the_grappler_engine(tmp_path):
    model = _model()
    model.compile(optimizer="sgd", loss="mse")
    engine = GrapplerEngine(log_dir=str(tmp_path))
    engine.apply(model, PrecisionLists(deny_layers=("ln",)))
    model.fit(tf.ones((4, 4)), tf.ones((4, 2)), epochs=1, verbose=0)
    by_engine = precision_report(model, engine)
    by_default = precision_report(model)  # the engine that last took effect
    assert by_engine["engine"] == by_default["engine"] == "grappler"
    assert by_engine["graph"] == by_default["graph"]
    train = by_engine["graph"]["train"]
    assert train["is_train"] is True
    # 2 forward, 2 weight gradients, 1 input gradient (d2 only: d1 sees data).
    assert train["converted_by_op"]["MatMul"] == 5
    assert "Rsqrt" not in train["converted_by_op"]
    assert by_engine["num_low_precision_layers"] == 0  # policies untouched
    engine.restore()
    # After training the report still describes what ran in the last epoch.
    after = precision_report(model)
    assert after["engine"] == "grappler"
    assert after["graph"]["train"]["converted_by_op"]["MatMul"] == 5
    assert "MatMul" in str(after) and "| MatMul | 5 |" in after.to_markdown()
    # A model no engine touched: the rewrite is off again, so "keras".
    assert precision_report(_model())["engine"] == "keras"


def test_a_graph_report_without_dump_dir_explains_how_to_get_one(monkeypatch):
    monkeypatch.delenv(LOG_PATH_VARIABLE, raising=False)
    with pytest.raises(ValueError, match=rf"set `{LOG_PATH_VARIABLE}` before"):
        precision_report(_model(), "grappler")


def test_an_itex_report_without_itex_says_it_is_missing(monkeypatch):
    from keras_amp_plus import _compat

    monkeypatch.setattr(_compat, "itex_module", lambda: None)
    with pytest.raises(ImportError, match="needs Intel Extension for TensorFlow"):
        precision_report(_model(), "itex")


def test_a_missing_dump_dir_is_an_error_not_an_empty_report(tmp_path):
    missing = str(tmp_path / "typo")
    with pytest.raises(ValueError, match=re.escape(f"Received: dump_dir={missing!r}")):
        precision_report(_model(), "grappler", log_dir=missing)


def test_unknown_engine_names_are_rejected():
    with pytest.raises(ValueError, match=r"Received: engine='tpu'"):
        precision_report(_model(), "tpu")

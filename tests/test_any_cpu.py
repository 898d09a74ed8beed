"""Engines say what really runs, on any CPU.

oneDNN is off by default on CPUs without AVX512, and then grappler's bfloat16
rewrite silently does nothing. The oneDNN-off cases run in a child process with
`TF_ENABLE_ONEDNN_OPTS=0`, so every machine tests them whatever it defaults to.
"""

import json
import os

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import run_python

from keras_amp_plus import precision_report
from keras_amp_plus._lists.precision_lists import PrecisionLists
from keras_amp_plus.callbacks import AMPMonitor
from keras_amp_plus.engines._grappler import GRAPPLER_OPTION

CHILD_SETUP = """
import json, os, logging
import numpy as np, keras, tensorflow as tf
from keras_amp_plus import _compat
from keras_amp_plus.callbacks import AMPMonitor
assert _compat.onednn_enabled() is False, "the child must run with oneDNN off"

def model():
    m = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, name="d1"),
         keras.layers.Dense(2, name="d2")],
        name="m",
    )
    return m

x = np.random.default_rng(0).normal(size=(32, 8)).astype("float32")
y = np.zeros((32, 2), "float32")
"""


def _child(body: str, **environment) -> str:
    return run_python(CHILD_SETUP + body, TF_ENABLE_ONEDNN_OPTS="0", **environment)


def test_grappler_engine_with_onednn_off_fails_before_the_first_step():
    out = _child(
        """
m = model()
m.compile(optimizer="sgd", loss="mse")
before = [w.copy() for w in m.get_weights()]
options = tf.config.optimizer.get_experimental_options()
try:
    m.fit(x, y, epochs=1, verbose=0, callbacks=[AMPMonitor(engine="grappler")])
except RuntimeError as error:
    message = str(error)
unchanged = all(np.array_equal(a, b) for a, b in zip(before, m.get_weights()))
print(json.dumps({
    "message": message,
    "unchanged": unchanged,
    "iterations": int(m.optimizer.iterations.numpy()),
    "options_unchanged": tf.config.optimizer.get_experimental_options() == options,
    "log_path": os.environ.get("TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_LOG_PATH"),
}))
"""
    )
    result = json.loads(out.strip().splitlines()[-1])
    assert "oneDNN is off" in result["message"]
    assert "TF_ENABLE_ONEDNN_OPTS=1" in result["message"]
    assert "engine='keras'" in result["message"]
    assert "Received: TF_ENABLE_ONEDNN_OPTS='0'" in result["message"]
    assert result["unchanged"] and result["iterations"] == 0
    assert result["options_unchanged"] and result["log_path"] is None


def test_slow_bfloat16_warns_once_from_a_cached_check(tmp_path):
    out = _child(
        """
records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append(record.getMessage())
logging.getLogger("keras_amp_plus").addHandler(Keep())
keras.config.set_dtype_policy("mixed_bfloat16")
for _ in range(2):  # a second fit neither warns again nor probes again
    m = model()
    m.compile(optimizer="sgd", loss="mse")
    m.fit(x, y, epochs=1, verbose=0, callbacks=[AMPMonitor()])
print(json.dumps([r for r in records if "computes in bfloat16" in r]))
""",
        KERAS_AMP_PLUS_CACHE_DIR=str(tmp_path),
    )
    warnings = json.loads(out.strip().splitlines()[-1])
    assert len(warnings) == 1
    assert "will train slower than float32" in warnings[0]
    assert "oneDNN kernels are off" in warnings[0] or "emulated" in warnings[0]
    assert "x float32, measured" in warnings[0]
    assert len(list(tmp_path.glob("bfloat16_probe_*.json"))) == 1


def _float32_model():
    model = keras.Sequential(
        [
            keras.Input((6, 6, 2)),
            keras.layers.Conv2D(4, 3, name="conv"),
            keras.layers.Flatten(name="flat"),
            keras.layers.Dense(8, name="d1"),
            keras.layers.Dense(2, name="d2"),
        ]
    )
    model.compile(optimizer="sgd", loss="mse")
    return model


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(16, 6, 6, 2)).astype("float32")
    return x, rng.normal(size=(16, 2)).astype("float32")


def test_auto_engine_leaves_a_float32_model_float32(tmp_path):
    model = _float32_model()
    lists = PrecisionLists(deny_layers=("d1",))
    monitor = AMPMonitor(str(tmp_path), lists=lists)
    model.fit(*_data(), epochs=2, verbose=0, callbacks=[monitor])
    assert monitor.engine.name == "keras"
    assert {layer.compute_dtype for layer in model.layers} == {"float32"}
    options = tf.config.optimizer.get_experimental_options()
    assert not options.get(GRAPPLER_OPTION)
    assert not any(
        name.startswith("TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE") for name in os.environ
    )
    assert precision_report(model)["num_low_precision_layers"] == 0


@pytest.mark.onednn
def test_a_chosen_grappler_engine_rewrites_with_empty_lists(tmp_path):
    model = _float32_model()
    monitor = AMPMonitor(str(tmp_path), engine="grappler")
    model.fit(*_data(), epochs=1, verbose=0, callbacks=[monitor])
    report = precision_report(model)  # the engine that ran, also after fit
    assert report["engine"] == "grappler"
    assert monitor.engine.dump_dir is not None
    converted = report["graph"]["train"]["converted_by_op"]
    assert converted.get("MatMul", 0) > 0 and converted.get("Conv2D", 0) > 0
    assert "Train function" in str(report)

"""The subprocess probe of ITEX's bfloat16 kernels, and what the doctor makes of it."""

import json
import os
import subprocess
import sys

import pytest
import tensorflow as tf

from keras_amp_plus import _compat, _hardware
from keras_amp_plus import _itex_probe as itex_probe
from keras_amp_plus.cli import (
    _doctor as doctor,
)
from keras_amp_plus.cli import (
    _doctor_text as doctor_text,
)
from keras_amp_plus.cli import (
    _recommendation as recommendation,
)

AVX2_ABORT = {
    "works": False,
    "backend": "AVX2",
    "reason": "a bfloat16 MatMul under ITEX killed the process (signal 6) on its "
    "AVX2 CPU backend",
}


def test_a_child_killed_by_abort_is_read_as_not_working():
    # What ITEX's AVX2 backend does on the first bfloat16 MatMul: a C++ abort.
    script = (
        "import os, sys\n"
        "sys.stderr.write('I itex_cpu_wrapper.cc:60] Intel Extension for "
        "Tensorflow* AVX2 CPU backend is loaded.\\n')\n"
        'sys.stderr.write("terminate called after throwing an instance of '
        "'dnnl::error'\\n\")\n"
        "sys.stderr.flush()\n"
        "os.abort()\n"
    )
    child = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=False
    )
    assert child.returncode < 0  # killed by a signal, no Python exception
    status = itex_probe.parse_child(child.returncode, child.stdout, child.stderr)
    assert status["works"] is False and status["backend"] == "AVX2"
    assert f"killed the process (signal {-child.returncode})" in status["reason"]
    assert "dnnl::error" in status["reason"]


def test_a_child_that_reports_finite_gradients_works():
    stdout = json.dumps({"finite": True, "itex_backend": "CPU"}) + "\n"
    status = itex_probe.parse_child(0, stdout, "AVX512 CPU backend is loaded.")
    assert status == {"works": True, "backend": "AVX512", "reason": ""}


def test_a_kernel_error_is_read_as_not_working_and_named_without_wrapping():
    # What ITEX's float16 layer norm raises on an AMD EPYC without AVX512-FP16.
    stderr = (
        "AVX512 CPU backend is loaded.\n"
        "tensorflow.python.framework.errors_impl.AbortedError: {{function_node "
        "__wrapped__ITEXLayerNorm_device_/job:localhost/replica:0/task:0/device:CPU:0}}"
        " Operation received an exception:Status:3, message: could not create a "
        "primitive descriptor for a layer normalization forward propagation "
        "primitive [Op:ITEXLayerNorm] name: \n"
    )
    status = itex_probe.parse_child(1, "", stderr, what="a float16 layer norm")
    assert status["works"] is False and status["backend"] == "AVX512"
    assert status["reason"] == (
        "a float16 layer norm under ITEX failed (exit status 1) on its AVX512 CPU "
        "backend (could not create a primitive descriptor for a layer "
        "normalization forward propagation primitive [Op:ITEXLayerNorm] name:)"
    )


def test_a_graph_error_is_named_by_the_kernels_message():
    # What ITEX's float16 layer norm raises inside a tf.function on an AMD
    # EPYC without AVX512 (TensorFlow's report spans lines).
    stderr = (
        "AVX2 CPU backend is loaded.\n"
        "tensorflow.python.framework.errors_impl.AbortedError: Graph execution "
        "error:\n\nDetected at node ITEXLayerNorm defined at (most recent call "
        'last):\n  File "<string>", line 16, in gradient_of_layer_norm\n\n'
        "Operation received an exception:Status:3, message: could not create a "
        "primitive descriptor for a layer normalization forward propagation "
        "primitive, in file ./itex/core/kernels/common/layer_norm_op.h:248\n"
        "\t [[{{node ITEXLayerNorm}}]] [Op:__inference_gradient_of_layer_norm_30]\n"
    )
    status = itex_probe.parse_child(1, "", stderr, what="a float16 layer norm")
    assert status["reason"] == (
        "a float16 layer norm under ITEX failed (exit status 1) on its AVX2 CPU "
        "backend (could not create a primitive descriptor for a layer "
        "normalization forward propagation primitive, in file "
        "./itex/core/kernels/common/layer_norm_op.h:248)"
    )


def test_an_abort_is_named_by_the_kernels_log_line():
    # The bfloat16 MatMul of a graph on ITEX's AVX2 backend: ITEX logs the
    # kernel's message, then the C++ exception aborts the process.
    stderr = (
        "AVX2 CPU backend is loaded.\n"
        "W itex/core/utils/op_kernel.cc:526] ./itex/core/kernels/common/"
        "matmul_op.h623Aborted: Operation received an exception:Status: 3, "
        "message: could not create a primitive descriptor for a matmul primitive, "
        "in file ./itex/core/kernels/common/matmul_op.h:620\n"
        "terminate called after throwing an instance of 'dnnl::error'\n"
        "  what():  object is not initialized\n"
    )
    status = itex_probe.parse_child(-6, "", stderr)
    assert status["reason"] == (
        "a bfloat16 MatMul under ITEX killed the process (signal 6) on its AVX2 "
        "CPU backend (could not create a primitive descriptor for a matmul "
        "primitive, in file ./itex/core/kernels/common/matmul_op.h:620)"
    )


def test_each_probe_has_its_own_answer_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv(_hardware.CACHE_DIR_VARIABLE, str(tmp_path))
    files = {probe: itex_probe._cache_file(probe) for probe in itex_probe.PROBES}
    assert len(set(files.values())) == len(itex_probe.PROBES)
    itex_probe._write_cache(AVX2_ABORT, "bfloat16_matmul")
    assert itex_probe._read_cache("float16_layer_norm") is None


def test_an_unknown_probe_is_refused_by_name():
    with pytest.raises(ValueError, match=r"Received: probe='int8_matmul'"):
        itex_probe.probe_status("int8_matmul")


def test_the_answer_is_cached_on_disk_per_machine_and_versions(tmp_path, monkeypatch):
    monkeypatch.setenv(_hardware.CACHE_DIR_VARIABLE, str(tmp_path))
    first = itex_probe._cache_file()
    assert first.startswith(str(tmp_path))
    itex_probe._write_cache(AVX2_ABORT)
    assert itex_probe._read_cache() == AVX2_ABORT
    # Another oneDNN setting is another key: the answer is not reused.
    monkeypatch.setenv(
        "TF_ENABLE_ONEDNN_OPTS",
        "0" if os.environ.get("TF_ENABLE_ONEDNN_OPTS") != "0" else "1",
    )
    assert itex_probe._cache_file() != first
    assert itex_probe._read_cache() is None


@pytest.mark.itex
def test_the_probe_on_this_machine(tmp_path, monkeypatch):
    monkeypatch.setenv(_hardware.CACHE_DIR_VARIABLE, str(tmp_path))
    itex_probe.itex_bfloat16_status.cache_clear()
    try:
        status = itex_probe.itex_bfloat16_status()
    finally:
        itex_probe.itex_bfloat16_status.cache_clear()
    assert status["backend"] in ("AVX512", "AVX2")
    if status["backend"] == "AVX2":  # an AMD EPYC without AVX512
        assert not status["works"] and "MatMul" in status["reason"]
    else:  # Intel Xeons with AVX512 run bfloat16 there
        assert status["works"], status["reason"]
    # Written to disk: a second process would not run the child again.
    assert os.listdir(tmp_path) == [os.path.basename(itex_probe._cache_file())]


@pytest.mark.itex
@pytest.mark.parametrize("dtype", ("bfloat16", "float16"))
def test_the_layer_norm_probe_tells_what_the_kernel_does(dtype, tmp_path, monkeypatch):
    monkeypatch.setenv(_hardware.CACHE_DIR_VARIABLE, str(tmp_path))
    status = itex_probe.probe_status(f"{dtype}_layer_norm")
    # The same kernel in this process, eagerly: where the probe says no, it
    # raises (as it would inside a user's step); where yes, it runs.
    layer_norm = _compat.itex_layer_norm_op(tf.as_dtype(dtype))
    x = tf.ones((4, 16), dtype)
    try:
        layer_norm(x, tf.ones([16]), tf.zeros([16]), epsilon=1e-3, is_training=True)
        ran = True
    except tf.errors.OpError:
        ran = False
    assert ran == status["works"], status["reason"]
    if not ran:
        assert f"{dtype} layer norm" in status["reason"]


def test_the_doctor_recommends_float32_where_itex_bfloat16_aborts():
    advice = recommendation.recommend({}, itex_bfloat16=AVX2_ABORT)
    assert advice["policy"] == "float32"
    (warning,) = advice["warnings"]
    assert "signal 6" in warning and "engine='keras'" in warning
    assert "Train in float32" in warning
    itex = {"version": "2.15.0.0", "importable": True, "bfloat16": AVX2_ABORT}
    assert doctor.probe_dtypes(itex) == ("float32",)  # never bf16 in-process
    line = doctor_text._itex_line(itex)
    assert line.startswith("2.15.0.0 (importable; AVX2 CPU backend, bfloat16")
    assert "do not work" in line


def test_the_doctor_names_a_layer_norm_itex_cannot_run():
    works = {"works": True, "backend": "AVX512", "reason": ""}
    refused = {"works": False, "backend": "AVX512", "reason": "no primitive"}
    itex = {"version": "2.15.0.0", "importable": True, "bfloat16": works}
    assert "layer norm" not in doctor_text._itex_line(itex)
    line = doctor_text._itex_line({**itex, "float16_layer_norm": refused})
    assert "work; float16 layer norm does not work (no primitive)" in line
    assert "LayerNormalization runs its own kernels in float16" in line
    assert "bfloat16 layer norm" not in line
    both = {**itex, "bfloat16_layer_norm": refused, "float16_layer_norm": refused}
    line = doctor_text._itex_line(both)
    assert "work; bfloat16 layer norm does not work (no primitive)" in line
    assert "own kernels in bfloat16; float16 layer norm does not work" in line


def test_the_doctor_keeps_its_advice_where_itex_bfloat16_works():
    works = {"works": True, "backend": "AVX512", "reason": ""}
    advice = recommendation.recommend({"bfloat16": 3.4}, itex_bfloat16=works)
    assert advice["policy"] == "mixed_bfloat16"
    assert any("engine='itex'" in note for note in advice["notes"])
    itex = {"version": "2.15.0.0", "importable": True, "bfloat16": works}
    assert "bfloat16" in doctor.probe_dtypes(itex)


def test_the_doctor_reports_itex_on_this_stack():
    status = doctor.itex_status()
    if _compat.itex_module() is None:
        assert "bfloat16" not in status
    else:
        assert status["importable"] and status["version"].startswith("2.15.0")
        assert set(status["bfloat16"]) == {"works", "backend", "reason"}
        for probe in ("bfloat16_layer_norm", "float16_layer_norm"):
            assert set(status[probe]) == {"works", "backend", "reason"}

"""The doctor: CPU flag parsing, the recommendation, rendering, and a real run."""

import ast
import json
import os
import subprocess
import sys

import keras
import pytest
import tensorflow as tf

from keras_amp_plus import _hardware as cpu_features
from keras_amp_plus import _matmul_probe as matmul_probe
from keras_amp_plus._bfloat16_outlook import bfloat16_outlook
from keras_amp_plus.cli import _doctor as doctor
from keras_amp_plus.cli import _doctor_text as doctor_text
from keras_amp_plus.cli._recommendation import recommend
from keras_amp_plus.layers import _swish_calibration

SAPPHIRE_RAPIDS = """\
processor\t: 0
vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme avx2 avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
"""
GRANITE_RAPIDS_FLAGS = "flags\t\t: avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_fp16\n"
SKYLAKE = "model name\t: Intel(R) Xeon(R) Gold 6148\nflags\t\t: fpu avx2 avx512f\n"
GRAVITON = "processor\t: 0\nFeatures\t: fp asimd bf16 i8mm sve\nCPU part\t: 0xd40\n"

NO_FEATURES = dict.fromkeys(cpu_features.LOW_PRECISION_FLAGS, False)


@pytest.mark.parametrize(
    "text, expected",
    [
        (
            SAPPHIRE_RAPIDS,
            {**NO_FEATURES, "amx_bf16": True, "avx512_bf16": True, "avx512_fp16": True},
        ),
        (GRANITE_RAPIDS_FLAGS, dict.fromkeys(NO_FEATURES, True)),
        (SKYLAKE, NO_FEATURES),
        (GRAVITON, NO_FEATURES),
        ("", NO_FEATURES),
    ],
    ids=["sapphire_rapids", "granite_rapids", "skylake", "arm", "empty"],
)
def test_low_precision_features_from_cpuinfo_text(text, expected):
    flags = cpu_features.parse_cpu_flags(text)
    assert cpu_features.low_precision_features(flags) == expected


def test_parse_cpu_flags_reads_arm_features_line():
    assert {"asimd", "bf16", "sve"} <= cpu_features.parse_cpu_flags(GRAVITON)


def test_parse_cpu_model():
    assert cpu_features.parse_cpu_model(SKYLAKE) == "Intel(R) Xeon(R) Gold 6148"
    assert cpu_features.parse_cpu_model(GRAVITON) is None


def test_parse_cpu_signature_tells_generations_under_one_brand_apart():
    zen5 = "cpu family\t: 26\nmodel\t\t: 2\nmodel name\t: AMD EPYC\n"
    zen4 = "cpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
    assert cpu_features.parse_cpu_signature(zen5) == "family 26 model 2"
    assert cpu_features.parse_cpu_signature(zen4) == "family 25 model 17"
    assert cpu_features.parse_cpu_signature(SAPPHIRE_RAPIDS) == "family 6 model 143"
    assert cpu_features.parse_cpu_signature(GRAVITON) is None


def test_cpu_status_without_cpuinfo_reports_unknown(tmp_path):
    status = doctor.cpu_status(str(tmp_path / "no_such_cpuinfo"))
    assert status["features"] is None
    assert status["model"] is None
    assert cpu_features.has_any(status["features"], cpu_features.BFLOAT16_FLAGS) is None


def test_cpu_status_reads_the_given_file(tmp_path):
    path = tmp_path / "cpuinfo"
    path.write_text(SAPPHIRE_RAPIDS)
    status = doctor.cpu_status(str(path))
    assert status["model"] == "Intel(R) Xeon(R) Platinum 8480+"
    assert status["signature"] == "family 6 model 143"
    assert status["features"]["amx_bf16"] is True
    assert status["features"]["amx_fp16"] is False


def test_recommend_fast_bfloat16():
    advice = recommend({"bfloat16": 4.3, "float16": 0.4})
    assert advice["policy"] == "mixed_bfloat16"
    assert advice["summary"] == (
        "bfloat16 matmuls run 4.3x faster than float32 here: use mixed_bfloat16"
    )
    assert advice["warnings"] == []
    assert advice["notes"] == [
        "float16 matmuls run 2.5x slower than float32 here: use mixed_float16 to "
        "test loss scaling, not for speed"
    ]


def test_recommend_warns_when_bfloat16_is_slower_without_hardware():
    features = cpu_features.low_precision_features(
        cpu_features.parse_cpu_flags(SKYLAKE)
    )
    advice = recommend({"bfloat16": 0.25, "float16": 0.2}, features=features)
    assert advice["policy"] == "float32"
    assert advice["verdict"] == "slower"
    assert advice["summary"].startswith(
        "WARNING: mixed_bfloat16 would slow training here: this CPU has neither "
        "AMX-BF16 nor AVX512-BF16, so bfloat16 is emulated (bfloat16 matmul "
        "throughput 0.25x float32, measured). Instead, train in float32"
    )
    assert advice["warnings"] == []


@pytest.mark.parametrize(
    "speedup, says",
    [
        (0.3, "but bfloat16 runs slower than float32 on this CPU"),
        (3.6, "AMPMonitor(engine='itex') turns on its Advanced AMP"),
    ],
)
def test_the_itex_note_agrees_with_the_bfloat16_verdict(speedup, says):
    if speedup < 1:
        flags = cpu_features.parse_cpu_flags(SKYLAKE)
        features = cpu_features.low_precision_features(flags)
    else:
        features = dict.fromkeys(NO_FEATURES, True)
    working = {"works": True, "backend": "avx512", "reason": None}
    advice = recommend({"bfloat16": speedup}, features=features, itex_bfloat16=working)
    itex_notes = [note for note in advice["notes"] if "ITEX" in note]
    assert len(itex_notes) == 1 and says in itex_notes[0]
    assert "avx512 CPU backend" in itex_notes[0]


def test_recommend_slow_bfloat16_on_capable_cpu_blames_no_hardware():
    advice = recommend({"bfloat16": 0.5}, features=dict.fromkeys(NO_FEATURES, True))
    assert advice["policy"] == "float32"
    assert advice["summary"].startswith("WARNING:")
    assert advice["warnings"] == []


def test_recommend_similar_speed_keeps_float32():
    advice = recommend({"bfloat16": 1.05})
    assert advice["policy"] == "float32"
    assert advice["verdict"] == "no clear difference"
    assert "about as fast as float32 (1.05x)" in advice["summary"]
    assert advice["notes"] == []


@pytest.mark.parametrize("speedup", [0.6, 0.86, 0.9, 0.95, 1.1, 1.2])
def test_verdict_on_a_cpu_without_bfloat16_is_stable(speedup):
    # A noisy probe near a threshold must not flip the advice: the hardware
    # (no bfloat16 instructions) decides, the figure is only reported.
    advice = recommend({"bfloat16": speedup}, features=NO_FEATURES, onednn=False)
    assert (advice["policy"], advice["verdict"]) == ("float32", "slower")
    assert "would slow training" in advice["summary"]
    assert f"{speedup:.2f}x float32, measured" in advice["summary"]


@pytest.mark.parametrize(
    ("speedup", "verdict"),
    [
        (0.5, "slower"),
        (0.87, "slower"),
        (0.9, "no clear difference"),
        (1.14, "no clear difference"),
        (1.15, "faster"),
        (None, "unknown"),
    ],
)
def test_verdict_band_when_the_hardware_is_unknown(speedup, verdict):
    assert recommend({"bfloat16": speedup})["verdict"] == verdict


def test_capable_cpu_without_a_figure_is_expected_fast():
    features = dict.fromkeys(NO_FEATURES, True)
    advice = recommend({"bfloat16": None}, features=features, onednn=True)
    assert (advice["verdict"], advice["policy"]) == ("faster", "mixed_bfloat16")


@pytest.mark.parametrize(
    ("env", "expected", "absent"),
    [
        (None, "off by default on this CPU; set TF_ENABLE_ONEDNN_OPTS=1", "unset"),
        ("0", "TF_ENABLE_ONEDNN_OPTS=0 turns it off; set it to 1", "by default"),
    ],
)
def test_onednn_advice_fits_the_environment(env, expected, absent):
    advice = recommend(
        {"bfloat16": 0.9}, features=NO_FEATURES, onednn=False, onednn_env=env
    )
    (warning,) = advice["warnings"]
    assert expected in warning
    assert absent not in warning
    assert "on this CPU it will not make bfloat16 fast" in warning


@pytest.mark.parametrize(
    ("onednn", "allocator_env", "noted"),
    [
        (False, None, True),
        (False, "1", False),
        (False, "0", False),
        (True, None, False),
    ],
)
def test_allocator_note_only_where_onednn_is_off_and_it_is_unset(
    onednn, allocator_env, noted
):
    # Without oneDNN, TensorFlow's malloc allocations of large tensors are
    # mapped afresh every step; a setting the user made is theirs to keep.
    advice = recommend(
        {"bfloat16": 1.0},
        features=NO_FEATURES,
        onednn=onednn,
        allocator_env=allocator_env,
    )
    notes = [n for n in advice["notes"] if "TF_CPU_ALLOCATOR_USE_BFC=1" in n]
    assert len(notes) == int(noted)
    if noted:
        assert notes[0].startswith("set TF_CPU_ALLOCATOR_USE_BFC=1 before")


def test_outlook_caches_the_probe_figure(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_AMP_PLUS_CACHE_DIR", str(tmp_path))
    probe = {"results": {"float32": {}, "bfloat16": {"speedup_vs_float32": 0.42}}}
    fresh = bfloat16_outlook(probe=probe)
    cached = bfloat16_outlook(measure=False)
    assert fresh["speedup"] == cached["speedup"] == 0.42
    assert len(list(tmp_path.glob("bfloat16_probe_*.json"))) == 1
    assert cached["verdict"] == "slower"  # 0.42 <= 0.87, whatever the CPU
    assert "0.42x float32, measured" in cached["reason"]


def test_recommend_float16_only_when_clearly_fastest():
    advice = recommend({"bfloat16": 1.3, "float16": 6.0})
    assert advice["policy"] == "mixed_float16"
    assert advice["summary"].startswith("float16 matmuls run 6.0x faster than float32")
    assert "LossScaleOptimizer" in advice["summary"]
    # Nearly equal speeds: bfloat16 wins because it needs no loss scaling.
    assert recommend({"bfloat16": 4.0, "float16": 4.2})["policy"] == "mixed_bfloat16"


def test_recommend_unmeasured_bfloat16():
    advice = recommend({"bfloat16": None, "float16": None})
    assert advice["policy"] == "float32"
    assert "could not be measured" in advice["summary"]


def test_recommend_warns_about_onednn_off_and_xla():
    advice = recommend({"bfloat16": 4.0}, onednn=False, fit_uses_xla=True)
    assert advice["verdict"] == "slower"  # oneDNN off: emulated bfloat16
    capable = dict.fromkeys(NO_FEATURES, True)
    advice_on_amx = recommend({"bfloat16": 0.8}, features=capable, onednn=False)
    assert (
        "Instead, this CPU has bfloat16 instructions: set "
        in (advice_on_amx["summary"])
    )
    assert len(advice["warnings"]) == 2
    assert "oneDNN is off" in advice["warnings"][0]
    assert "jit_compile=False" in advice["warnings"][1]


def _facts(features):
    probe_results = {
        "float32": {"wall_ms": 8.0, "cpu_ms": 16.0, "tflops": 0.27},
        "bfloat16": {"wall_ms": 2.0, "cpu_ms": 4.0, "tflops": 1.07},
        "float16": {"error": "NotFoundError: no kernel"},
    }
    matmul_probe._add_speedups(probe_results, "cpu_ms")
    return {
        "versions": {
            "python": "3.11.7",
            "tensorflow": "2.21.0",
            "keras": "3.15.1",
            "keras_backend": "tensorflow",
            "keras_amp_plus": "0.1.0",
            "itex": {"version": "2.15.0.0", "importable": False},
        },
        "onednn": {"enabled": True, "TF_ENABLE_ONEDNN_OPTS": None},
        "cpu": {"system": "Darwin", "machine": "arm64", "model": None, **features},
        "devices": [{"name": "/physical_device:CPU:0", "type": "CPU"}],
        "xla": {"jit_compile": False},
        "probe": {"size": 1024, "seconds": 2.0, "results": probe_results},
        "recommendation": recommend({"bfloat16": 4.0}),
    }


@pytest.mark.parametrize(
    "speedup, expected, words",
    [
        (1.6, True, "ran 1.6x faster than without here (mixed_bfloat16): pass"),
        (1.05, False, "about as fast as (1.05x) without here"),
        (0.5, False, "ran 2.0x slower than without here"),
    ],
)
def test_jit_recommended_only_where_it_measured_faster(speedup, expected, words):
    jit_probe = {"policy": "mixed_bfloat16", "speedup": speedup}
    advice = recommend({"bfloat16": 4.0}, jit_probe=jit_probe)
    assert advice["jit_compile"] is expected
    (note,) = [n for n in advice["notes"] if "jit_compile" in n]
    assert words in note
    assert ("pass jit_compile=True" in note) is expected


def test_jit_unmeasured_gives_no_advice_failed_probe_keeps_it_off():
    assert recommend({"bfloat16": 4.0})["jit_compile"] is None
    failed = {"policy": "float32", "error": "InvalidArgumentError: no kernel"}
    advice = recommend({"bfloat16": 4.0}, jit_probe=failed)
    assert advice["jit_compile"] is None
    assert any("could not be measured" in note for note in advice["notes"])


def test_doctor_passes_the_probe_result_to_the_advice(monkeypatch, tmp_path):
    from keras_amp_plus.cli import _jit_probe

    monkeypatch.setenv("KERAS_AMP_PLUS_CACHE_DIR", str(tmp_path))
    seen = {}

    def fake_probe(seconds, policy):
        seen["policy"] = policy
        return {
            "policy": policy,
            "graph_ms": 30.0,
            "jit_ms": 10.0,
            "speedup": 3.0,
            "rounds": 3,
        }

    monkeypatch.setattr(_jit_probe, "probe_jit_speedup", fake_probe)
    for race in ("layer_paths_status", "xla_sums_status"):
        monkeypatch.setattr(
            doctor,
            race,
            lambda seconds, itex: {"cache": "x", "measured_now": False, "cells": []},
        )
    facts = doctor.gather_facts(probe_seconds=0.2, probe_size=128)
    assert seen["policy"] == facts["recommendation"]["policy"]
    assert facts["recommendation"]["jit_compile"] is True
    text = doctor_text.render(facts)
    assert "30.0 CPU ms per step without, 10.0 with jit_compile=True" in text
    assert "pass jit_compile=True to compile()" in text


def test_layer_paths_not_measured_with_itex_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_AMP_PLUS_CACHE_DIR", str(tmp_path))
    status = doctor.layer_paths_status(5.0, {"version": "2.15", "importable": True})
    assert status["cells"] == [] and "ITEX" in status["skipped"]
    assert os.listdir(tmp_path) == []
    facts = {"layer_paths": status}
    assert "not measured: ITEX is loaded" in doctor_text._layer_paths_line(
        facts["layer_paths"]
    )
    cells = [{"path": "batch_norm"}, {"path": "keras_formula"}, {"path": "batch_norm"}]
    line = doctor_text._layer_paths_line(
        {"cache": "c", "measured_now": True, "cells": cells}
    )
    assert line == "fastest at 3 cells: batch_norm 2, keras_formula 1 (measured now)"


def test_swish_sigmoid_race_not_run_with_itex_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_AMP_PLUS_CACHE_DIR", str(tmp_path))
    status = doctor.swish_sigmoid_status(5.0, {"version": "2.15", "importable": True})
    assert status["cells"] == [] and "ITEX" in status["skipped"]
    assert os.listdir(tmp_path) == []
    line = doctor_text._swish_sigmoid_line(status)
    assert line == "not measured: ITEX is loaded: its kernels replace TensorFlow's"


def test_xla_sums_race_not_run_with_itex_loaded(tmp_path, monkeypatch):
    monkeypatch.setenv("KERAS_AMP_PLUS_CACHE_DIR", str(tmp_path))
    status = doctor.xla_sums_status(5.0, {"version": "2.15", "importable": True})
    assert status["cells"] == [] and "ITEX" in status["skipped"]
    assert os.listdir(tmp_path) == []
    line = doctor_text._xla_sums_line(status)
    assert line == "not measured: ITEX is loaded: its kernels replace TensorFlow's"


def test_xla_sums_line_counts_the_products_wins_per_precision():
    cells = [
        {"dtype": "float32", "elements": 2**16, "ratio": 0.9},
        {"dtype": "bfloat16", "elements": 2**16, "ratio": 1.1},
        {"dtype": "bfloat16", "elements": 2**18, "ratio": 0.7},
    ]
    line = doctor_text._xla_sums_line({"measured_now": True, "cells": cells})
    assert (
        line == "batched products won at bfloat16 1/2, float32 1/1 sizes (measured now)"
    )
    assert doctor_text._xla_sums_line({"measured_now": False, "cells": []}) == (
        "products everywhere (not measured: the default)"
    )


def test_swish_sigmoid_line_names_each_threshold():
    cells = [{"dtype": "float32", "elements": 2**19, "ratio": 0.9}]
    status = {"measured_now": False, "cells": cells}
    line = doctor_text._swish_sigmoid_line(
        {**status, "thresholds": {"float32": 2**19, "float16": 2**20}}
    )
    assert line == (
        "recomputes the sigmoid: float32 from 512K, float16 from 1M elements (cached)"
    )
    unmeasured = {"measured_now": False, "cells": [], "thresholds": {"float32": 2**22}}
    assert "float32 from 4M elements (not measured: the defaults)" in (
        doctor_text._swish_sigmoid_line(unmeasured)
    )
    assert doctor_text._swish_sigmoid_line(
        {"measured_now": False, "cells": [], "thresholds": {}}
    ) == ("keeps the sigmoid in every precision here")
    never = _swish_calibration.NEVER  # keeping won at the largest raced size
    kept = {**status, "thresholds": {"float32": never, "bfloat16": 2**23}}
    assert doctor_text._swish_sigmoid_line(kept) == (
        "recomputes the sigmoid: bfloat16 from 8M elements; reads it off the "
        "output in float32 (cached)"
    )
    assert doctor_text._swish_sigmoid_line(
        {**status, "thresholds": {"float32": never, "float16": never}}
    ) == (
        "never recomputes the sigmoid here; keeps it in float16; reads it off the "
        "output in float32 (cached)"
    )


def test_jit_probe_measures_both_modes_and_restores_the_policy():
    from keras_amp_plus.cli import _jit_probe

    before = keras.config.dtype_policy().name
    result = _jit_probe.probe_jit_speedup(seconds=0.1, policy="mixed_bfloat16")
    assert keras.config.dtype_policy().name == before
    assert result["policy"] == "mixed_bfloat16"
    assert result["rounds"] >= _jit_probe.MIN_ROUNDS
    assert result["graph_ms"] > 0 and result["jit_ms"] > 0
    assert result["speedup"] == pytest.approx(result["graph_ms"] / result["jit_ms"])


def test_render_text():
    text = doctor_text.render(_facts({"features": None}))
    assert "CPU             Darwin arm64\n" in text
    assert "CPU features    unknown (no /proc/cpuinfo on Darwin)" in text
    assert "ITEX            2.15.0.0 (not importable on this stack)" in text
    assert "oneDNN          on (TF_ENABLE_ONEDNN_OPTS unset, TF's default)" in text
    assert "Devices         CPU:0" in text
    assert "4.00x" in text  # bfloat16 row: 16 / 4 CPU ms
    assert "float16     not available: NotFoundError" in text
    assert text.endswith("use mixed_bfloat16")


def test_render_names_the_cpu_generation():
    facts = _facts({"features": NO_FEATURES})
    facts["cpu"].update(model="AMD EPYC", signature="family 26 model 2")
    assert "CPU             AMD EPYC (family 26 model 2)\n" in doctor_text.render(facts)


def test_probe_measures_every_dtype():
    probe = matmul_probe.probe_matmul_throughput(seconds=0.3, size=128, rounds=3)
    assert set(probe["results"]) == {"float32", "bfloat16", "float16"}
    assert probe["results"]["float32"]["speedup_vs_float32"] == pytest.approx(1.0)
    for result in probe["results"].values():
        assert result["tflops"] > 0 and result["wall_ms"] > 0
        assert 1 <= result["rounds"] <= 3


def test_probe_rejects_non_positive_budget():
    with pytest.raises(ValueError, match="Received: seconds=0"):
        matmul_probe.probe_matmul_throughput(seconds=0)


def _run_doctor(*args, env_updates=None):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env_updates or {})}
    return subprocess.run(
        [sys.executable, "-m", "keras_amp_plus", "doctor", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )


def test_doctor_json_on_this_machine(tmp_path):
    completed = _run_doctor(
        "--json",
        "--probe-seconds",
        "0.5",
        env_updates={"KERAS_AMP_PLUS_CACHE_DIR": str(tmp_path)},
    )
    assert completed.returncode == 0, completed.stderr
    facts = json.loads(completed.stdout)
    assert set(facts) == {
        "versions",
        "onednn",
        "cpu",
        "devices",
        "xla",
        "probe",
        "jit_probe",
        "layer_paths",
        "swish_sigmoid",
        "xla_sums",
        "cache",
        "recommendation",
    }
    assert facts["cache"] == {"dir": str(tmp_path), "writable": True}
    # The first run says it measures, for minutes, and where it keeps them.
    assert "measuring the layers' paths on this CPU" in completed.stderr
    assert f"kept in {tmp_path} for later runs" in completed.stderr
    jit_probe = facts["jit_probe"]
    assert jit_probe["policy"] == facts["recommendation"]["policy"]
    assert jit_probe["speedup"] == pytest.approx(
        jit_probe["graph_ms"] / jit_probe["jit_ms"]
    )
    assert facts["recommendation"]["jit_compile"] is (
        jit_probe["speedup"] >= cpu_features.FASTER_THRESHOLD
    )
    # The layers' path measurement ran (empty cache) and was cached there.
    layer_paths = facts["layer_paths"]
    assert layer_paths["measured_now"] and layer_paths["cells"]
    assert layer_paths["cache"].startswith(str(tmp_path))
    with open(layer_paths["cache"], encoding="utf-8") as file:
        assert json.load(file)["cells"] == layer_paths["cells"]
    # So did Swish's sigmoid race (float32 always has a threshold).
    swish = facts["swish_sigmoid"]
    assert swish["measured_now"] and swish["cells"]
    assert swish["cache"].startswith(str(tmp_path))
    assert "float32" in swish["thresholds"]
    # And instance norm's sums race inside XLA, smallest sizes first.
    xla_sums = facts["xla_sums"]
    assert xla_sums["measured_now"] and xla_sums["cells"]
    assert xla_sums["cache"].startswith(str(tmp_path))
    assert xla_sums["cells"][0]["elements"] == 8 * 16 * 16 * 32
    assert all(cell["ratio"] > 0 for cell in xla_sums["cells"])
    assert facts["versions"]["tensorflow"] == tf.__version__
    assert facts["versions"]["keras"] == keras.__version__
    assert facts["versions"]["keras_backend"] == "tensorflow"
    physical = tf.config.list_physical_devices()
    assert [d["name"] for d in facts["devices"]] == [d.name for d in physical]
    accelerators = [d for d in physical if d.device_type != "CPU"]
    assert facts["xla"]["jit_compile"] is bool(accelerators)
    if os.path.exists("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as cpuinfo:
            words = set(cpuinfo.read().split())
        assert facts["cpu"]["features"]["amx_bf16"] is ("amx_bf16" in words)
        assert facts["cpu"]["features"]["avx512_bf16"] is ("avx512_bf16" in words)
    results = facts["probe"]["results"]
    assert results["float32"]["speedup_vs_float32"] == pytest.approx(1.0)
    assert 0 < results["bfloat16"]["tflops"] < 1000
    assert facts["recommendation"]["policy"] in (
        "float32",
        "mixed_bfloat16",
        "mixed_float16",
    )


@pytest.mark.parametrize("setting, expected", [("0", False), ("1", True)])
def test_onednn_status_follows_env(setting, expected):
    code = (
        "from keras_amp_plus.cli import _doctor as doctor; "
        "print(doctor.onednn_status())"
    )
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", "TF_ENABLE_ONEDNN_OPTS": setting}
    completed = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=True,
    )
    status = ast.literal_eval(completed.stdout.strip())
    assert status == {"enabled": expected, "TF_ENABLE_ONEDNN_OPTS": setting}


def test_cache_status_says_where_and_whether_it_can_write(tmp_path, monkeypatch):
    monkeypatch.setenv(cpu_features.CACHE_DIR_VARIABLE, str(tmp_path / "cache"))
    assert doctor.cache_status() == {"dir": str(tmp_path / "cache"), "writable": True}
    blocked = tmp_path / "a_file"
    blocked.write_text("")  # no directory can be made under a file, even as root
    monkeypatch.setenv(cpu_features.CACHE_DIR_VARIABLE, str(blocked / "cache"))
    status = doctor.cache_status()
    assert status == {"dir": str(blocked / "cache"), "writable": False}
    facts = _facts({"features": None})
    facts["cache"] = status
    text = doctor_text.render(facts)
    assert f"Cache           {blocked / 'cache'} is not writable: every run" in text
    assert "set KERAS_AMP_PLUS_CACHE_DIR to a writable directory" in text

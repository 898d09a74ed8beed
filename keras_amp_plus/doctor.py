"""`python -m keras_amp_plus doctor`: is mixed precision worth it on this machine.

The doctor gathers facts into a plain dict (versions, oneDNN, CPU low-precision
features, devices, whether Keras XLA-compiles `fit`, a short matmul probe), turns
them into a recommendation (`keras_amp_plus.recommendation.recommend`) and renders
them as text or JSON. Each part is a small function so it can be tested alone.
"""

import importlib.metadata
import json
import os
import platform
import sys

import keras
import tensorflow as tf

from keras_amp_plus import (
    _compat,
    cpu_features,
    doctor_text,
    itex_probe,
    matmul_probe,
    recommendation,
)

ITEX_DISTRIBUTIONS = (
    "intel-extension-for-tensorflow",
    "intel_extension_for_tensorflow",
)


def stack_problems() -> list:
    """Return what makes this stack unusable for keras_amp_plus (empty if fine).

    Example:
    >>> stack_problems()
    []
    """
    problems = []
    if keras.backend.backend() != "tensorflow":
        problems.append(
            "Keras runs on the "
            f"{keras.backend.backend()!r} backend; keras_amp_plus needs "
            "'tensorflow': set KERAS_BACKEND=tensorflow"
        )
    return problems


def itex_status() -> dict:
    """Return ITEX's version (or None), whether it imports, and its bfloat16 state.

    Where ITEX imports, `"bfloat16"` holds the subprocess probe's answer
    (`keras_amp_plus.itex_probe`): `{"works", "backend", "reason"}`; on ITEX's
    AVX2 CPU backend the first bfloat16 MatMul aborts the process.
    """
    version = None
    for distribution in ITEX_DISTRIBUTIONS:
        try:
            version = importlib.metadata.version(distribution)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    # Importing ITEX loads its kernels: only try when it is installed at all.
    importable = version is not None and _compat.itex_module() is not None
    status = {"version": version, "importable": importable}
    if importable:
        status["bfloat16"] = itex_probe.itex_bfloat16_status()
    return status


def probe_dtypes(itex: dict) -> tuple:
    """Return the dtypes the in-process matmul probe may run.

    With ITEX loaded its kernels run every MatMul; where its bfloat16 kernels
    abort the process, only float32 is measured.
    """
    if itex.get("importable") and not itex.get("bfloat16", {}).get("works", True):
        return ("float32",)
    return matmul_probe.DEFAULT_DTYPES


def versions() -> dict:
    """Return the versions of Python, TensorFlow, Keras, keras_amp_plus and ITEX."""
    from keras_amp_plus import __version__

    return {
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "keras_backend": keras.backend.backend(),
        "keras_amp_plus": __version__,
        "itex": itex_status(),
    }


def onednn_status() -> dict:
    """Return whether oneDNN kernels are on and the `TF_ENABLE_ONEDNN_OPTS` value."""
    return {
        "enabled": _compat.onednn_enabled(),
        "TF_ENABLE_ONEDNN_OPTS": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
    }


def cpu_status(cpuinfo_path: str = cpu_features.CPUINFO_PATH) -> dict:
    """Return the CPU model and its low-precision features (None when unknown)."""
    text = cpu_features.read_cpuinfo(cpuinfo_path)
    flags = None if text is None else cpu_features.parse_cpu_flags(text)
    return {
        "system": platform.system(),
        "machine": platform.machine(),
        "model": None if text is None else cpu_features.parse_cpu_model(text),
        "features": cpu_features.low_precision_features(flags),
    }


def device_list() -> list:
    """Return the visible physical devices as `{"name", "type"}` dicts."""
    return [
        {"name": device.name, "type": device.device_type}
        for device in tf.config.list_physical_devices()
    ]


def fit_xla_status() -> dict:
    """Return whether Keras would XLA-compile `fit` for a model here.

    Asks Keras itself: a tiny model compiled with `jit_compile="auto"` reports
    what it resolved to (False on CPU-only machines and under tf.distribute).
    """
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", jit_compile=_compat.JIT_COMPILE_DEFAULT)
    return {"jit_compile": bool(model.jit_compile)}


def gather_facts(probe_seconds: float = 2.0, probe_size: int = 1024) -> dict:
    """Collect everything the doctor reports, including the recommendation.

    Args:
        probe_seconds: time budget of the matmul probe. Defaults to `2.0`.
        probe_size: side of the probe's square matrices. Defaults to `1024`.

    Returns:
        A JSON-serializable dict with keys `"versions"`, `"onednn"`, `"cpu"`,
        `"devices"`, `"xla"`, `"probe"` and `"recommendation"`.
    """
    stack = versions()
    facts = {
        "versions": stack,
        "onednn": onednn_status(),
        "cpu": cpu_status(),
        "devices": device_list(),
        "xla": fit_xla_status(),
        "probe": matmul_probe.probe_matmul_throughput(
            probe_seconds, probe_size, dtypes=probe_dtypes(stack["itex"])
        ),
    }
    speedups = {
        dtype: result.get("speedup_vs_float32")
        for dtype, result in facts["probe"]["results"].items()
    }
    facts["recommendation"] = recommendation.recommend(
        speedups,
        features=facts["cpu"]["features"],
        onednn=facts["onednn"]["enabled"],
        fit_uses_xla=facts["xla"]["jit_compile"],
        itex_bfloat16=stack["itex"].get("bfloat16"),
    )
    return facts


def main(json_output: bool = False, probe_seconds: float = 2.0) -> int:
    """Run the doctor, print text or JSON, and return the process exit code.

    Args:
        json_output: print JSON instead of text. Defaults to `False`.
        probe_seconds: time budget of the matmul probe. Defaults to `2.0`.

    Returns:
        0, or 1 when the stack cannot run keras_amp_plus (message on stderr).
    """
    if probe_seconds <= 0:
        raise ValueError(
            f"`probe_seconds` must be positive. Received: probe_seconds={probe_seconds}"
        )
    problems = stack_problems()
    if problems:
        for problem in problems:
            print(f"keras_amp_plus doctor: {problem}", file=sys.stderr)
        return 1
    facts = gather_facts(probe_seconds)
    print(json.dumps(facts, indent=2) if json_output else doctor_text.render(facts))
    return 0

"""The machine a benchmark runs on: printed in every header, stored in every JSON.

Figures mean little without the CPU they came from: bfloat16 is about 2x float32
end to end on an Intel Xeon with AMX and about 0.5x on a CPU without bfloat16
instructions. Every script calls `print_header` first and stores `describe()`
under `"machine"` in its JSON.
"""

import os
import platform

import keras
import tensorflow as tf

from keras_amp_plus import _compat, _hardware


def describe() -> dict:
    """Return the CPU model, its low-precision features, oneDNN and versions."""
    cpu = _hardware.cpu_facts()
    return {
        "cpu_model": cpu["model"] or f"{cpu['system']} {cpu['machine']}",
        "low_precision_features": cpu["features"],
        "bfloat16_instructions": _hardware.has_any(
            cpu["features"], _hardware.BFLOAT16_FLAGS
        ),
        "onednn": _compat.onednn_enabled(),
        "TF_ENABLE_ONEDNN_OPTS": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
    }


def kind(machine: dict) -> str:
    """Return a short file-name tag for the CPU kind, e.g. `intel-amx`."""
    features = machine["low_precision_features"] or {}
    vendor = "intel" if "intel" in machine["cpu_model"].lower() else "other"
    if "amd" in machine["cpu_model"].lower():
        vendor = "amd"
    if features.get("amx_bf16"):
        return f"{vendor}-amx"
    if features.get("avx512_bf16"):
        return f"{vendor}-avx512bf16"
    return f"{vendor}-nobf16"


def print_header(title: str) -> dict:
    """Print the benchmark's title and the machine; return `describe()`."""
    machine = describe()
    features = machine["low_precision_features"]
    flags = "unknown"
    if features is not None:
        present = [
            label
            for flag, label in _hardware.LOW_PRECISION_FLAGS.items()
            if features[flag]
        ]
        flags = ", ".join(present) or "none (bfloat16 is emulated: slow)"
    onednn = {True: "on", False: "off", None: "unknown"}[machine["onednn"]]
    print(title)
    print(f"CPU: {machine['cpu_model']} ({machine['cpu_count']} cores)")
    print(f"low-precision instructions: {flags}; oneDNN {onednn}")
    print(f"TensorFlow {machine['tensorflow']}, Keras {machine['keras']}")
    print()
    return machine

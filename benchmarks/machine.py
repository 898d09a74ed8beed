"""The machine a benchmark runs on: printed in every header, stored in every JSON.

Figures mean little without the CPU they came from: bfloat16 is about 2x float32
end to end on an Intel Xeon with AMX and about 0.5x on a CPU without bfloat16
instructions. Every script calls `print_header` first, stores its result under
`"machine"` in its JSON, and names its result file with `cpu_kind()`.
"""

import os
import platform

import keras
import tensorflow as tf

from keras_amp_plus import _compat, _hardware


def describe() -> dict:
    """Return the CPU model, its low-precision features, oneDNN and versions."""
    text = _hardware.read_cpuinfo()
    flags = _hardware.parse_cpu_flags(text) if text else None
    return {
        "model": _hardware.parse_cpu_model(text) if text else None,
        "features": _hardware.low_precision_features(flags),
        "avx512f": None if flags is None else "avx512f" in flags,
        "onednn": _compat.onednn_enabled(),
        "TF_ENABLE_ONEDNN_OPTS": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
    }


def cpu_kind(machine: dict) -> str:
    """Return a short file-name tag for the CPU kind, e.g. `intel_amx`.

    A run with oneDNN switched off where TensorFlow would have it on gets
    `_onednn_off`: it approximates a CPU without oneDNN and is kept apart.
    """
    model = (machine["model"] or "unknown").lower()
    vendor = "intel" if "intel" in model else "amd" if "amd" in model else "cpu"
    features = machine["features"] or {}
    if features.get("amx_bf16"):
        tag = f"{vendor}_amx"
    else:
        tag = f"{vendor}_avx512" if machine["avx512f"] else f"{vendor}_avx2"
    return tag + ("_onednn_off" if machine["onednn"] is False else "")


def print_header(title: str) -> dict:
    """Print the benchmark's title and the machine; return `describe()`."""
    machine = describe()
    features = machine["features"]
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
    print(f"CPU: {machine['model']} ({machine['cpu_count']} cores)")
    print(
        f"low-precision instructions: {flags}; AVX512F: {machine['avx512f']}; "
        f"oneDNN {onednn}"
    )
    print(f"TensorFlow {machine['tensorflow']}, Keras {machine['keras']}")
    print()
    return machine

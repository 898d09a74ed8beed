"""The machine a benchmark runs on: printed in every header, stored in every JSON.

Figures mean little without the CPU they came from: bfloat16 is about 2x float32
end to end on an Intel Xeon with AMX and about 0.5x on a CPU without bfloat16
instructions. Every script calls `print_header` first, stores its result under
`"machine"` in its JSON, and names its result file with `cpu_kind()`.
"""

import argparse
import json
import os
import pathlib
import platform
import re
import sys

import keras
import tensorflow as tf

from keras_amp_plus import _compat, _hardware


def describe() -> dict:
    """Return the CPU model, its low-precision features, oneDNN and versions."""
    text = _hardware.read_cpuinfo()
    flags = _hardware.parse_cpu_flags(text) if text else None
    return {
        "model": _hardware.parse_cpu_model(text) if text else None,
        "signature": _hardware.parse_cpu_signature(text) if text else None,
        "features": _hardware.low_precision_features(flags),
        "avx512f": None if flags is None else "avx512f" in flags,
        "onednn": _compat.onednn_enabled(),
        "TF_ENABLE_ONEDNN_OPTS": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
        "xla_max_isa": xla_max_isa(),
        "cpu_count": os.cpu_count(),
        "platform": platform.platform(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
    }


def xla_max_isa():
    """Return the `--xla_cpu_max_isa` cap in `XLA_FLAGS`, or None."""
    # XLA takes the last of repeated flags.
    found = re.findall(r"--xla_cpu_max_isa=(\w+)", os.environ.get("XLA_FLAGS", ""))
    return found[-1].upper() if found else None


def cpu_kind(machine: dict) -> str:
    """Return a short file-name tag for the CPU kind, e.g. `intel_amx`.

    AMD CPUs carry their Zen generation (`amd_zen4_avx512`) where the
    family and model numbers name one.

    A run with oneDNN switched off where TensorFlow would have it on gets
    `_onednn_off`: it approximates a CPU without oneDNN and is kept apart; a
    cap on XLA's instruction set (`XLA_FLAGS=--xla_cpu_max_isa=AVX2`) adds
    `_xla_avx2`.
    """
    model = (machine["model"] or "unknown").lower()
    vendor = "intel" if "intel" in model else "amd" if "amd" in model else "cpu"
    if vendor == "amd":
        # One AMD model name ("AMD EPYC") covers generations that measure
        # differently (Zen 4 and Zen 5 both have AVX512-BF16).
        vendor += amd_generation(machine.get("signature"))
    features = machine["features"] or {}
    if features.get("amx_bf16"):
        tag = f"{vendor}_amx"
    else:
        tag = f"{vendor}_avx512" if machine["avx512f"] else f"{vendor}_avx2"
    tag += "_onednn_off" if machine["onednn"] is False else ""
    isa = machine.get("xla_max_isa")
    return tag + (f"_xla_{isa.lower()}" if isa else "")


# AMD family 25 (0x19) holds Zen 3 and Zen 4 by model range; 23 (0x17)
# holds Zen 1 and Zen 2; 26 (0x1A) Zen 5 and, at other models, Zen 6 (left
# untagged: unknown models get no generation rather than a wrong one).
_AMD_GENERATIONS = {
    23: ((0x00, 0x2F, "zen1"), (0x30, 0xFF, "zen2")),
    25: (
        (0x00, 0x0F, "zen3"),
        (0x10, 0x1F, "zen4"),
        (0x20, 0x5F, "zen3"),
        (0x60, 0xAF, "zen4"),
    ),
    26: ((0x00, 0x2F, "zen5"), (0x40, 0x4F, "zen5"), (0x60, 0x7F, "zen5")),
}


def amd_generation(signature) -> str:
    """Return `_zenN` for an AMD `family F model M` signature, else `""`.

    Example:
    >>> amd_generation("family 25 model 17")
    '_zen4'
    >>> amd_generation(None)
    ''
    """
    found = re.fullmatch(r"family (\d+) model (\d+)", signature or "")
    if not found:
        return ""
    family, model = map(int, found.groups())
    for first, last, name in _AMD_GENERATIONS.get(family, ()):
        if first <= model <= last:
            return f"_{name}"
    return ""


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
    isa = machine["xla_max_isa"]
    print(title)
    signature = f", {machine['signature']}" if machine["signature"] else ""
    print(f"CPU: {machine['model']} ({machine['cpu_count']} cores{signature})")
    print(
        f"low-precision instructions: {flags}; AVX512F: {machine['avx512f']}; "
        f"oneDNN {onednn}" + (f"; XLA capped at {isa}" if isa else "")
    )
    print(f"TensorFlow {machine['tensorflow']}, Keras {machine['keras']}")
    print()
    return machine


def write_results(output, machine: dict, document: dict, **meta) -> None:
    """Write `document` as JSON to `output` with the run's metadata.

    The metadata: the machine (`describe()`), its CPU kind, the command line
    and `meta` (the run's options).
    """
    meta = {
        "cpu": machine,
        "cpu_kind": cpu_kind(machine),
        "command": " ".join(["python", *sys.argv]),
        **meta,
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"meta": meta, **document}, indent=1) + "\n")
    print(f"wrote {output}")


RESULTS = pathlib.Path(__file__).parent / "results"


def sweep_options(doc, title, name, quick_help, reps, dtypes=None):
    """Parse a sweep's command line, print its header and name its JSON.

    The options every sweep takes: `--quick` (`quick_help`; 5 reps), `--reps`
    (default `reps`), `--output` (default `results/<name>_<cpu kind>.json`,
    `_quick` added for quick runs) and, where `dtypes` is given, `--dtypes`.

    Returns:
        `(args, machine, output, reps)`: the parsed options, `print_header`'s
        description of the machine, the JSON's path and the repetitions.
    """
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--reps", type=int, default=None, help=f"default {reps}")
    if dtypes:
        parser.add_argument("--dtypes", nargs="+", default=list(dtypes), choices=dtypes)
    parser.add_argument("--output", type=pathlib.Path, default=None)
    args = parser.parse_args()
    machine = print_header(title)
    suffix = "_quick" if args.quick else ""
    output = args.output or RESULTS / f"{name}_{cpu_kind(machine)}{suffix}.json"
    return args, machine, output, args.reps or (5 if args.quick else reps)

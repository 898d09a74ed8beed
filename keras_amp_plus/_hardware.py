"""What this machine's CPU can do in low precision, and whether bfloat16 pays.

Which low-precision instructions the CPU has is read from `/proc/cpuinfo`.

Whether bfloat16 or float16 training is faster than float32 on a CPU depends on
a few instruction-set extensions: AMX-BF16 and AVX512-BF16 give oneDNN fast
bfloat16 matmuls, AVX512-FP16 and AMX-FP16 fast float16 ones. Without them TF
emulates the low-precision math and it runs slower than float32 (tensorflow
issues 42422 and 45441). Linux lists the extensions in the `flags` line of
`/proc/cpuinfo`; other systems have no such file, and the features are then
reported as unknown (`None`) rather than guessed.

`keras_amp_plus._bfloat16_outlook.bfloat16_outlook()`, the one verdict the
doctor and `AMPMonitor` share, builds on these facts: "faster", "slower", "no
clear difference" or "unknown". Where the hardware
decides (no bfloat16 instructions, or oneDNN off), the verdict follows the
hardware and a measurement only gives the figure, so it does not flip between
runs; elsewhere it follows a matmul probe with a band of no clear difference
between `SLOWER_THRESHOLD` and `FASTER_THRESHOLD`. Probe results are cached on
disk per CPU model, flags, TensorFlow version and oneDNN state, so `fit` never
pays for a probe more than once per machine.
"""

import hashlib
import json
import os
import platform
from collections.abc import Mapping

# Linux flag name -> the name Intel's documentation uses.
LOW_PRECISION_FLAGS = {
    "amx_bf16": "AMX-BF16",
    "avx512_bf16": "AVX512-BF16",
    "avx512_fp16": "AVX512-FP16",
    "amx_fp16": "AMX-FP16",
}

BFLOAT16_FLAGS = ("amx_bf16", "avx512_bf16")
FLOAT16_FLAGS = ("amx_fp16", "avx512_fp16")

CPUINFO_PATH = "/proc/cpuinfo"


def parse_cpu_flags(cpuinfo_text: str) -> frozenset:
    r"""Return the set of CPU flags listed in the text of `/proc/cpuinfo`.

    x86 kernels list them on `flags` lines, ARM kernels on `Features` lines; every
    core repeats them, so the union of all such lines is returned.

    Args:
        cpuinfo_text: the contents of `/proc/cpuinfo`.

    Returns:
        A frozenset of lower-case flag names, empty when the text has no flag line.

    Example:
    >>> text = "processor\t: 0\nflags\t\t: fpu avx512f amx_bf16 amx_tile\n"
    >>> sorted(parse_cpu_flags(text))
    ['amx_bf16', 'amx_tile', 'avx512f', 'fpu']
    >>> parse_cpu_flags("")
    frozenset()
    """
    flags = set()
    for line in cpuinfo_text.splitlines():
        key, separator, value = line.partition(":")
        if separator and key.strip().lower() in ("flags", "features"):
            flags.update(value.lower().split())
    return frozenset(flags)


def parse_cpu_model(cpuinfo_text: str) -> str | None:
    r"""Return the first `model name` in `/proc/cpuinfo` text, or None.

    Args:
        cpuinfo_text: the contents of `/proc/cpuinfo`.

    Example:
    >>> parse_cpu_model("model name\t: Intel(R) Xeon(R) Platinum 8480+\n")
    'Intel(R) Xeon(R) Platinum 8480+'
    """
    return _first_value(cpuinfo_text, "model name")


def _first_value(cpuinfo_text: str, key: str) -> str | None:
    """Return the value of the first `key : value` line for `key`, or None."""
    for line in cpuinfo_text.splitlines():
        name, separator, value = line.partition(":")
        if separator and name.strip().lower() == key:
            return value.strip()
    return None


def parse_cpu_signature(cpuinfo_text: str) -> str | None:
    r"""Return the first CPU's `family F model M` from `/proc/cpuinfo`, or None.

    Virtual machines often name the CPU only by its brand (`AMD EPYC`), while
    two generations under one name race the layers' paths differently; the
    family and model numbers tell them apart (AMD's Zen 4 is family 25, Zen 5
    family 26).

    Args:
        cpuinfo_text: the contents of `/proc/cpuinfo`.

    Example:
    >>> parse_cpu_signature("cpu family\t: 26\nmodel\t\t: 2\n")
    'family 26 model 2'
    >>> parse_cpu_signature("Features\t: fp asimd\n") is None
    True
    """
    family = _first_value(cpuinfo_text, "cpu family")
    model = _first_value(cpuinfo_text, "model")
    if family is None or model is None:
        return None
    return f"family {family} model {model}"


def low_precision_features(flags: frozenset | None) -> dict | None:
    """Return which low-precision extensions are present among `flags`.

    Args:
        flags: CPU flags from `parse_cpu_flags`, or None when they could not be
            read (then the features are unknown and None is returned).

    Returns:
        A dict from Linux flag name (`"amx_bf16"`, `"avx512_bf16"`,
        `"avx512_fp16"`, `"amx_fp16"`) to bool, or None.

    Example:
    >>> low_precision_features(frozenset({"avx512f", "avx512_bf16"}))
    {'amx_bf16': False, 'avx512_bf16': True, 'avx512_fp16': False, 'amx_fp16': False}
    >>> low_precision_features(None) is None
    True
    """
    if flags is None:
        return None
    return {flag: flag in flags for flag in LOW_PRECISION_FLAGS}


def read_cpuinfo(path: str = CPUINFO_PATH) -> str | None:
    """Return the text of `/proc/cpuinfo`, or None where there is none.

    Args:
        path: the file to read. Defaults to `"/proc/cpuinfo"`.
    """
    if not os.path.exists(path):
        return None
    try:
        with open(path, encoding="utf-8", errors="replace") as cpuinfo:
            return cpuinfo.read()
    except OSError:
        # Sandboxes can hide /proc; unknown features beat a crashed doctor.
        return None


# TensorFlow reads it at start-up: "1" or "true" pools CPU memory in its BFC
# allocator; unset, CPU tensors come from malloc unless oneDNN's allocator
# takes them (oneDNN on).
ALLOCATOR_VARIABLE = "TF_CPU_ALLOCATOR_USE_BFC"


def allocator_unpooled(onednn: bool | None) -> bool:
    """Return True where TensorFlow allocates CPU tensors with plain malloc.

    That is oneDNN off and `TF_CPU_ALLOCATOR_USE_BFC` unset: glibc then maps
    large tensors afresh, and page-faults them in, at every step
    (`benchmarks/cpu_allocator.py`). An explicit setting is the user's choice.

    Args:
        onednn: whether TensorFlow's oneDNN kernels are on (None: unknown).

    Example:
    >>> import os
    >>> allocator_unpooled(onednn=True)
    False
    >>> allocator_unpooled(onednn=False) is (ALLOCATOR_VARIABLE not in os.environ)
    True
    """
    return onednn is False and os.environ.get(ALLOCATOR_VARIABLE) is None


def has_xpu() -> bool:
    """Return True when TensorFlow sees an Intel XPU (through ITEX)."""
    import tensorflow as tf

    return bool(tf.config.list_physical_devices("XPU"))


def has_any(features: Mapping[str, bool] | None, flags: tuple) -> bool | None:
    """Return whether any of `flags` is present, or None when features are unknown.

    Args:
        features: the result of `low_precision_features`.
        flags: flag names to look for, e.g. `BFLOAT16_FLAGS`.

    Example:
    >>> has_any({"amx_bf16": False, "avx512_bf16": True}, BFLOAT16_FLAGS)
    True
    >>> has_any(None, BFLOAT16_FLAGS) is None
    True
    """
    if features is None:
        return None
    return any(features.get(flag, False) for flag in flags)


# A speed-up counts when it is clearly outside the noise of a short probe.
FASTER_THRESHOLD = 1.15
SLOWER_THRESHOLD = 0.87
CACHE_DIR_VARIABLE = "KERAS_AMP_PLUS_CACHE_DIR"
QUICK_PROBE = {"seconds": 0.5, "size": 512}


def cpu_facts(path: str = CPUINFO_PATH) -> dict:
    """Return `{"system", "machine", "model", "signature", "features"}` of this CPU.

    `model`, `signature` (`parse_cpu_signature`) and `features` are None
    when `/proc/cpuinfo` cannot be read.

    Args:
        path: the cpuinfo file. Defaults to `"/proc/cpuinfo"`.
    """
    text = read_cpuinfo(path)
    flags = None if text is None else parse_cpu_flags(text)
    return {
        "system": platform.system(),
        "machine": platform.machine(),
        "model": None if text is None else parse_cpu_model(text),
        "signature": None if text is None else parse_cpu_signature(text),
        "features": low_precision_features(flags),
    }


def speedup_verdict(
    speedup: float | None,
    features: Mapping[str, bool] | None,
    onednn: bool | None,
) -> str:
    """Return whether bfloat16 training is "faster", "slower" than float32 here.

    Also "no clear difference" (a measurement inside the noise band) or
    "unknown" (nothing to go on).

    Args:
        speedup: measured float32 / bfloat16 matmul time, or None.
        features: `low_precision_features` of the CPU, or None if unknown.
        onednn: whether TensorFlow's oneDNN kernels are on, or None.

    Example:
    >>> speedup_verdict(0.95, {"amx_bf16": False, "avx512_bf16": False}, False)
    'slower'
    >>> speedup_verdict(4.1, {"amx_bf16": True, "avx512_bf16": True}, True)
    'faster'
    >>> speedup_verdict(1.0, None, None)
    'no clear difference'
    """
    if has_any(features, BFLOAT16_FLAGS) is False or onednn is False:
        # Emulated bfloat16: slower at model scale whatever one probe says.
        return "slower"
    if speedup is None:
        fast_hardware = has_any(features, BFLOAT16_FLAGS) and onednn
        return "faster" if fast_hardware else "unknown"
    if speedup >= FASTER_THRESHOLD:
        return "faster"
    if speedup <= SLOWER_THRESHOLD:
        return "slower"
    return "no clear difference"


def slow_bfloat16_reason(features, onednn, speedup) -> str:
    """Return why bfloat16 is slow here, in one sentence with the figure."""
    if has_any(features, BFLOAT16_FLAGS) is False:
        cause = "this CPU has neither AMX-BF16 nor AVX512-BF16, so bfloat16 is emulated"
    elif onednn is False:
        cause = (
            "TensorFlow's oneDNN kernels are off (TF_ENABLE_ONEDNN_OPTS), so "
            "bfloat16 is emulated"
        )
    else:
        cause = "bfloat16 matmuls measured slower than float32"
    if speedup is not None:
        cause += f" (bfloat16 matmul throughput {speedup:.2f}x float32, measured)"
    return cause


def cache_dir() -> str:
    """Return the directory of the on-disk probe cache.

    `$KERAS_AMP_PLUS_CACHE_DIR`, else `$XDG_CACHE_HOME/keras_amp_plus`, else
    `~/.cache/keras_amp_plus`.
    """
    if os.environ.get(CACHE_DIR_VARIABLE):
        return os.environ[CACHE_DIR_VARIABLE]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return os.path.join(base, "keras_amp_plus")


def _probe_cache_path(facts: dict, tf_version: str, onednn) -> str:
    key = json.dumps([facts, tf_version, onednn], sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(cache_dir(), f"bfloat16_probe_{digest}.json")


def read_json_cache(path: str):
    """Return the JSON value cached at `path`, or None when absent or broken."""
    try:
        with open(path, encoding="utf-8") as file:
            return json.load(file)
    except (OSError, ValueError):
        return None


def write_json_cache(path: str, value) -> None:
    """Cache `value` at `path` atomically; a read-only disk only costs a probe.

    Written to a temporary file and renamed, so a concurrent reader (another
    test worker, another training process) never sees half a file.
    """
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        temporary = f"{path}.{os.getpid()}.tmp"
        with open(temporary, "w", encoding="utf-8") as file:
            json.dump(value, file)
        os.replace(temporary, path)
    except OSError:
        pass


def read_cached_speedup(path: str) -> float | None:
    """Return the bfloat16 speed-up cached at `path`, or None."""
    cached = read_json_cache(path)
    try:
        return float(cached["bfloat16_speedup"])
    except (KeyError, TypeError, ValueError):
        return None


def write_cached_speedup(path: str, speedup: float | None) -> None:
    """Cache a measured bfloat16 speed-up (a failed probe is not cached)."""
    if speedup is not None:
        write_json_cache(path, {"bfloat16_speedup": speedup})

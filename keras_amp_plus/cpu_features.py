"""Which low-precision instructions this CPU has, read from `/proc/cpuinfo`.

Whether bfloat16 or float16 training is faster than float32 on a CPU depends on
a few instruction-set extensions: AMX-BF16 and AVX512-BF16 give oneDNN fast
bfloat16 matmuls, AVX512-FP16 and AMX-FP16 fast float16 ones. Without them TF
emulates the low-precision math and it runs slower than float32 (tensorflow
issues 42422 and 45441). Linux lists the extensions in the `flags` line of
`/proc/cpuinfo`; other systems have no such file, and the features are then
reported as unknown (`None`) rather than guessed.
"""

import os
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
    for line in cpuinfo_text.splitlines():
        key, separator, value = line.partition(":")
        if separator and key.strip().lower() == "model name":
            return value.strip()
    return None


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

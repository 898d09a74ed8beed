"""Can ITEX run bfloat16 on this CPU? Asked of a child process, never of this one.

ITEX's CPU build picks a backend by CPU: "AVX512" on Intel Xeons with AVX512,
"AVX2" elsewhere. On the AVX2 backend float32 works but the first bfloat16
MatMul aborts the whole process from C++ (`dnnl::error`, "could not create a
primitive descriptor for a matmul primitive"): there is no Python exception to
catch. So a child Python runs one bfloat16 MatMul forward and backward and
reports; a child killed by a signal means "no". The answer is cached for the
process and on disk, keyed by the CPU's flags and the ITEX, TensorFlow and
Python versions, because the child costs several seconds (it imports
TensorFlow).
"""

import functools
import hashlib
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys

from keras_amp_plus import _hardware

_BACKEND_PATTERN = re.compile(r"(\w+) CPU backend is loaded")
_CHILD_TIMEOUT_SECONDS = 300

# Runs in the child: import ITEX, then one bfloat16 MatMul forward + backward.
_CHILD_SCRIPT = """
import json
import intel_extension_for_tensorflow as itex
import tensorflow as tf

a = tf.cast(tf.random.stateless_normal((64, 64), seed=(1, 2)), tf.bfloat16)
with tf.GradientTape() as tape:
    tape.watch(a)
    product = tf.linalg.matmul(a, a)
gradient = tape.gradient(product, a)
finite = bool(tf.reduce_all(tf.math.is_finite(tf.cast(gradient, tf.float32))))
backend = itex.get_backend()
backend = backend.decode() if isinstance(backend, bytes) else str(backend)
print(json.dumps({"finite": finite, "itex_backend": backend}))
"""


def _cpu_flags() -> str:
    """Return the CPU's feature flags ("" where /proc/cpuinfo is missing)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "none"


def cache_key() -> str:
    """Return the key the on-disk answer is stored under."""
    parts = [
        _cpu_flags(),
        _version("intel-extension-for-tensorflow"),
        _version("tensorflow"),
        sys.version,
        os.environ.get("TF_ENABLE_ONEDNN_OPTS", ""),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def _cache_file() -> str:
    return os.path.join(_hardware.cache_dir(), f"itex_bfloat16_{cache_key()}.json")


def _read_cache():
    return _hardware.read_json_cache(_cache_file())


def _write_cache(status: dict) -> None:
    _hardware.write_json_cache(_cache_file(), status)


def parse_child(returncode: int, stdout: str, stderr: str) -> dict:
    r"""Turn the child's exit into `{"works", "backend", "reason"}`.

    Args:
        returncode: the child's exit status (negative: killed by that signal).
        stdout: what it printed (one JSON line on success).
        stderr: its log, where ITEX names its backend and errors appear.

    Returns:
        A dict: `works` (bool), `backend` ("AVX512", "AVX2", ... or None) and
        `reason` ("" when it works).

    Example:
    >>> status = parse_child(-6, "", "AVX2 CPU backend is loaded.\nterminate called")
    >>> status["works"], status["backend"]
    (False, 'AVX2')
    >>> status["reason"]
    'a bfloat16 MatMul under ITEX killed the process (signal 6) on its AVX2 CPU backend'

    """
    match = _BACKEND_PATTERN.search(stderr)
    backend = match.group(1) if match else None
    last_line = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    if returncode == 0 and last_line.startswith("{"):
        result = json.loads(last_line)
        if result.get("finite"):
            return {"works": True, "backend": backend, "reason": ""}
        reason = "a bfloat16 MatMul under ITEX returned non-finite gradients"
        return {"works": False, "backend": backend, "reason": reason}
    # The last error line names the cause (TF's start-up noise comes first).
    errors = [
        line.strip()
        for line in stderr.splitlines()
        if "error" in line.lower() and "Unable to register" not in line
    ]
    error = errors[-1] if errors else ""
    how = (
        f"killed the process (signal {-returncode})"
        if returncode < 0
        else f"failed (exit status {returncode})"
    )
    reason = (
        f"a bfloat16 MatMul under ITEX {how}"
        + (f" on its {backend} CPU backend" if backend else "")
        + (f" ({error[:200]})" if error else "")
    )
    return {"works": False, "backend": backend, "reason": reason}


def run_child(python: str = sys.executable) -> dict:
    """Run the bfloat16 probe in a child Python and return `parse_child`'s dict."""
    environ = dict(os.environ)
    environ["TF_CPP_MIN_LOG_LEVEL"] = "0"  # ITEX names its backend at INFO level
    environ.setdefault("ITEX_CPP_MIN_LOG_LEVEL", "0")
    try:
        child = subprocess.run(
            [python, "-c", _CHILD_SCRIPT],
            capture_output=True,
            text=True,
            timeout=_CHILD_TIMEOUT_SECONDS,
            env=environ,
            check=False,
        )
    except subprocess.TimeoutExpired:
        return {
            "works": False,
            "backend": None,
            "reason": f"the probe took longer than {_CHILD_TIMEOUT_SECONDS} s",
        }
    return parse_child(child.returncode, child.stdout, child.stderr)


@functools.cache
def itex_bfloat16_status(use_disk_cache: bool = True) -> dict:
    """Return whether ITEX's bfloat16 kernels work on this CPU.

    Cached for the process and (unless `use_disk_cache=False`) on disk under
    `$KERAS_AMP_PLUS_CACHE_DIR` (default `~/.cache/keras_amp_plus`).

    Args:
        use_disk_cache: read and write the on-disk answer. Defaults to `True`.

    Returns:
        `{"works": bool, "backend": str or None, "reason": str}`; without ITEX
        installed, `works` is False and `reason` says so.
    """
    if _version("intel-extension-for-tensorflow") == "none":
        return {
            "works": False,
            "backend": None,
            "reason": "Intel Extension for TensorFlow is not installed",
        }
    status = _read_cache() if use_disk_cache else None
    if status is None:
        status = run_child()
        if use_disk_cache:
            _write_cache(status)
    return status

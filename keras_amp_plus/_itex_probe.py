"""Can ITEX's kernels run a dtype on this CPU? Asked of a child process, not this one.

ITEX's CPU build picks a backend by CPU: "AVX512" on CPUs with AVX512, "AVX2"
elsewhere, and its oneDNN kernels exist for fewer dtypes than the op
registrations promise. On the AVX2 backend float32 works but the first
bfloat16 MatMul of a graph aborts the whole process from C++ (`dnnl::error`,
"could not create a primitive descriptor for a matmul primitive"; the same
MatMul run eagerly works): there is no Python exception to catch. Its layer
norm fails in bfloat16 and float16, and on an AMD EPYC with AVX512-BF16 but no
AVX512-FP16 the AVX512 backend runs bfloat16 but its float16 layer norm fails
("could not create a primitive descriptor for a layer normalization forward
propagation primitive"), at the first call, in the middle of a user's training
step.

So each question is a probe: a child Python runs the kernel forward and
backward and reports; a child killed by a signal or failing means "no". The
answers are cached for the process and on disk, keyed by the probe, the CPU's
flags and the ITEX, TensorFlow and Python versions, because a child costs
several seconds (it imports TensorFlow).
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

# Run in the child: import ITEX, run one kernel forward + backward, print JSON.
# Inside a `tf.function`, as a training step runs it: on ITEX's AVX2 backend
# (an AMD EPYC without AVX512) the eager bfloat16 MatMul works, while the same
# MatMul in a graph aborts the process.
_BFLOAT16_MATMUL_SCRIPT = """
import json
import intel_extension_for_tensorflow as itex
import tensorflow as tf

a = tf.cast(tf.random.stateless_normal((64, 64), seed=(1, 2)), tf.bfloat16)

@tf.function
def gradient_of_product(a):
    with tf.GradientTape() as tape:
        tape.watch(a)
        product = tf.linalg.matmul(a, a)
    return tape.gradient(product, a)

gradient = gradient_of_product(a)
finite = bool(tf.reduce_all(tf.math.is_finite(tf.cast(gradient, tf.float32))))
backend = itex.get_backend()
backend = backend.decode() if isinstance(backend, bytes) else str(backend)
print(json.dumps({"finite": finite, "itex_backend": backend}))
"""

# The layer-norm op our LayerNormalization runs on the ITEX stack, in a half
# dtype (DTYPE), in a `tf.function` too.
_LAYER_NORM_SCRIPT = """
import json
import intel_extension_for_tensorflow as itex
import tensorflow as tf
from keras_amp_plus import _compat

layer_norm = _compat.itex_layer_norm_op(tf.DTYPE)
if layer_norm is None:
    raise SystemExit("error: this ITEX has no layer-norm op")
x = tf.cast(tf.random.stateless_normal((16, 64), seed=(1, 2)), tf.DTYPE)

@tf.function
def gradient_of_layer_norm(x):
    with tf.GradientTape() as tape:
        tape.watch(x)
        outputs = layer_norm(
            x, tf.ones([64]), tf.zeros([64]), epsilon=1e-3, is_training=True,
            data_format="NHWC",
        )[0]
    return tape.gradient(outputs, x)

gradient = gradient_of_layer_norm(x)
finite = bool(tf.reduce_all(tf.math.is_finite(tf.cast(gradient, tf.float32))))
print(json.dumps({"finite": finite}))
"""

# The half dtypes ITEX's layer norm is probed in (float32 always runs).
LAYER_NORM_PROBE_DTYPES = ("bfloat16", "float16")

# Probe name -> (child script, what it runs, as `parse_child`'s reasons name it).
PROBES = {
    "bfloat16_matmul": (_BFLOAT16_MATMUL_SCRIPT, "a bfloat16 MatMul"),
    **{
        f"{dtype}_layer_norm": (
            _LAYER_NORM_SCRIPT.replace("DTYPE", dtype),
            f"a {dtype} layer norm",
        )
        for dtype in LAYER_NORM_PROBE_DTYPES
    },
}


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


def cache_key(probe: str = "bfloat16_matmul") -> str:
    """Return the key the on-disk answer of `probe` is stored under."""
    parts = [
        probe,
        PROBES[probe][0],  # a changed probe asks afresh
        _cpu_flags(),
        _version("intel-extension-for-tensorflow"),
        _version("tensorflow"),
        sys.version,
        os.environ.get("TF_ENABLE_ONEDNN_OPTS", ""),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:20]


def _cache_file(probe: str = "bfloat16_matmul") -> str:
    name = f"itex_{probe}_{cache_key(probe)}.json"
    return os.path.join(_hardware.cache_dir(), name)


def _read_cache(probe: str = "bfloat16_matmul"):
    return _hardware.read_json_cache(_cache_file(probe))


def _write_cache(status: dict, probe: str = "bfloat16_matmul") -> None:
    _hardware.write_json_cache(_cache_file(probe), status)


# What TensorFlow wraps around a kernel's own message: the function node, the
# module path of the exception class, the "received an exception" preamble.
_BOILERPLATE = re.compile(
    r"\{\{function_node [^}]*\}\}\s*|tensorflow\.python\.framework\.errors_impl\."
    r"|Operation received an exception:Status:\d+, message: "
)


def _without_boilerplate(error: str) -> str:
    """Return a kernel's error line without TensorFlow's wrapping."""
    return _BOILERPLATE.sub("", error).strip()


def _cause(stderr: str) -> str:
    """Return what `stderr` says failed ("" where it says nothing)."""
    lines = [line.strip() for line in stderr.splitlines()]
    # ITEX's kernels say what failed after "message: ": in the log line before
    # an abort, and amid the lines of TensorFlow's report of a graph's error.
    messages = [line.split("message: ", 1)[1] for line in lines if "message: " in line]
    if messages:
        return messages[-1].strip()
    # Else the last error line (TensorFlow's start-up noise comes first).
    errors = [
        line
        for line in lines
        if "error" in line.lower() and "Unable to register" not in line
    ]
    return _without_boilerplate(errors[-1]) if errors else ""


def parse_child(
    returncode: int, stdout: str, stderr: str, what: str = "a bfloat16 MatMul"
) -> dict:
    r"""Turn the child's exit into `{"works", "backend", "reason"}`.

    Args:
        returncode: the child's exit status (negative: killed by that signal).
        stdout: what it printed (one JSON line on success).
        stderr: its log, where ITEX names its backend and errors appear.
        what: the kernel the child ran, as the reason names it.

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
        reason = f"{what} under ITEX returned non-finite gradients"
        return {"works": False, "backend": backend, "reason": reason}
    error = _cause(stderr)
    how = (
        f"killed the process (signal {-returncode})"
        if returncode < 0
        else f"failed (exit status {returncode})"
    )
    reason = (
        f"{what} under ITEX {how}"
        + (f" on its {backend} CPU backend" if backend else "")
        + (f" ({error[:200]})" if error else "")
    )
    return {"works": False, "backend": backend, "reason": reason}


def run_child(python: str = sys.executable, probe: str = "bfloat16_matmul") -> dict:
    """Run `probe` (a key of `PROBES`) in a child; return `parse_child`'s dict."""
    script, what = PROBES[probe]
    environ = dict(os.environ)
    environ["TF_CPP_MIN_LOG_LEVEL"] = "0"  # ITEX names its backend at INFO level
    environ.setdefault("ITEX_CPP_MIN_LOG_LEVEL", "0")
    try:
        child = subprocess.run(
            [python, "-c", script],
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
    return parse_child(child.returncode, child.stdout, child.stderr, what)


def probe_status(probe: str, use_disk_cache: bool = True) -> dict:
    """Return whether the kernel of `probe` (a key of `PROBES`) works on this CPU.

    Args:
        probe: `"bfloat16_matmul"`, `"bfloat16_layer_norm"` or
            `"float16_layer_norm"`.
        use_disk_cache: read and write the on-disk answer under
            `$KERAS_AMP_PLUS_CACHE_DIR` (default `~/.cache/keras_amp_plus`).
            Defaults to `True`.

    Returns:
        `{"works": bool, "backend": str or None, "reason": str}`; without ITEX
        installed, `works` is False and `reason` says so.

    Example:
    >>> probe_status("float16_layer_norm")["works"]  # doctest: +SKIP
    False
    """
    if probe not in PROBES:
        raise ValueError(
            f"Unknown ITEX kernel probe. Expected one of {sorted(PROBES)}. "
            f"Received: probe={probe!r}"
        )
    if _version("intel-extension-for-tensorflow") == "none":
        return {
            "works": False,
            "backend": None,
            "reason": "Intel Extension for TensorFlow is not installed",
        }
    status = _read_cache(probe) if use_disk_cache else None
    if status is None:
        status = run_child(probe=probe)
        if use_disk_cache:
            _write_cache(status, probe)
    return status


@functools.cache
def itex_bfloat16_status(use_disk_cache: bool = True) -> dict:
    """Return whether ITEX's bfloat16 MatMul works on this CPU (cached per process).

    Args:
        use_disk_cache: read and write the on-disk answer. Defaults to `True`.

    Returns:
        `probe_status("bfloat16_matmul")`'s dict.
    """
    return probe_status("bfloat16_matmul", use_disk_cache)


@functools.cache
def itex_layer_norm_status(dtype: str, use_disk_cache: bool = True) -> dict:
    """Return whether ITEX's layer norm runs `dtype` on this CPU (cached per process).

    Args:
        dtype: `"bfloat16"` or `"float16"`.
        use_disk_cache: read and write the on-disk answer. Defaults to `True`.

    Returns:
        `probe_status(f"{dtype}_layer_norm")`'s dict.

    Example:
    >>> itex_layer_norm_status("bfloat16")["works"]  # doctest: +SKIP
    True
    """
    return probe_status(f"{dtype}_layer_norm", use_disk_cache)

"""`python -m keras_amp_plus doctor`: is mixed precision worth it on this machine.

The doctor gathers facts into a plain dict (versions, oneDNN, CPU low-precision
features, devices, whether Keras XLA-compiles `fit`, a short matmul probe), turns
them into a recommendation (`keras_amp_plus.cli._recommendation.recommend`) and
renders them as text or JSON. Keras and TensorFlow are imported only after the
stack was checked, so a wrong Keras backend or a broken TensorFlow install is
reported instead of crashing the doctor.
"""

import importlib.metadata
import json
import os
import platform
import sys
import tempfile

from keras_amp_plus import _hardware
from keras_amp_plus.cli import (
    _doctor_text as doctor_text,
)
from keras_amp_plus.cli import (
    _recommendation as recommendation,
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
    try:
        import tensorflow  # noqa: F401
    except Exception as error:  # a broken install raises more than ImportError
        return [f"TensorFlow cannot be imported ({type(error).__name__}: {error})"]
    try:
        import keras
    except Exception as error:
        return [f"Keras cannot be imported ({type(error).__name__}: {error})"]
    backend = keras.backend.backend()
    if backend != "tensorflow":
        return [
            f"Keras runs on the {backend!r} backend; keras_amp_plus needs "
            "'tensorflow': set KERAS_BACKEND=tensorflow"
        ]
    return []


def itex_status() -> dict:
    """Return ITEX's version (or None), whether it imports, and its kernels' state.

    Where ITEX imports, `"bfloat16"`, `"bfloat16_layer_norm"` and
    `"float16_layer_norm"` hold the subprocess probes' answers
    (`keras_amp_plus._itex_probe`): `{"works", "backend", "reason"}`; on ITEX's
    AVX2 CPU backend the first bfloat16 MatMul of a graph aborts the process
    and its half-precision layer norms fail, and without AVX512-FP16 its
    float16 layer norm fails.
    """
    from keras_amp_plus import _compat, _itex_probe

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
        status["bfloat16"] = _itex_probe.itex_bfloat16_status()
        for dtype in _itex_probe.LAYER_NORM_PROBE_DTYPES:
            status[f"{dtype}_layer_norm"] = _itex_probe.itex_layer_norm_status(dtype)
    return status


def probe_dtypes(itex: dict) -> tuple:
    """Return the dtypes the in-process matmul probe may run.

    With ITEX loaded its kernels run every MatMul; where its bfloat16 kernels
    abort the process, only float32 is measured.
    """
    if itex.get("importable") and not itex.get("bfloat16", {}).get("works", True):
        return ("float32",)
    from keras_amp_plus import _matmul_probe

    return _matmul_probe.DEFAULT_DTYPES


def versions() -> dict:
    """Return the versions of Python, TensorFlow, Keras, keras_amp_plus and ITEX."""
    import keras
    import tensorflow as tf

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
    from keras_amp_plus import _compat

    return {
        "enabled": _compat.onednn_enabled(),
        "TF_ENABLE_ONEDNN_OPTS": os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
    }


def cpu_status(cpuinfo_path: str = _hardware.CPUINFO_PATH) -> dict:
    """Return the CPU model and its low-precision features (None when unknown)."""
    return _hardware.cpu_facts(cpuinfo_path)


def device_list() -> list:
    """Return the visible physical devices as `{"name", "type"}` dicts."""
    import tensorflow as tf

    return [
        {"name": device.name, "type": device.device_type}
        for device in tf.config.list_physical_devices()
    ]


def fit_xla_status() -> dict:
    """Return whether Keras would XLA-compile `fit` for a model here.

    Asks Keras itself: a tiny model compiled with `jit_compile="auto"` reports
    what it resolved to (False on CPU-only machines and under tf.distribute).
    """
    import keras

    from keras_amp_plus import _compat

    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse", jit_compile=_compat.JIT_COMPILE_DEFAULT)
    return {
        "jit_compile": bool(model.jit_compile),
        "default": _compat.JIT_COMPILE_DEFAULT,
    }


# The layers' path measurement gets this many times the probe budget (each
# shape is raced in steps traced for its batch size and for any batch size,
# in two passes: on a 2-core Intel Xeon Ice Lake, the slowest CPU measured,
# the first pass took 45 s and the second reached 38 of the 40 cells).
LAYER_PATHS_BUDGET_FACTOR = 40


def cache_status() -> dict:
    """Return where the measurements are cached and whether they can be.

    Returns:
        `{"dir", "writable"}`: the cache directory (`_hardware.cache_dir`)
        and whether a file can be written there (created if missing).

    Example:
    >>> sorted(cache_status())
    ['dir', 'writable']
    """
    directory = _hardware.cache_dir()
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            writable = True
    except OSError:
        writable = False
    return {"dir": directory, "writable": writable}


def _say_first_measurement(cache: dict) -> None:
    """Say on stderr that the layers are measured now, the first run's minutes.

    The path race takes most of them; the other races are cached with it.
    """
    from keras_amp_plus.layers import _path_calibration

    if _path_calibration.cached_cells():
        return
    where = (
        f"kept in {cache['dir']} for later runs"
        if cache["writable"]
        else f"{cache['dir']} is not writable, so every run measures again"
    )
    print(
        "keras_amp_plus doctor: measuring the layers' paths on this CPU "
        "(a few minutes, once per CPU model, TensorFlow version and oneDNN "
        f"setting; {where})",
        file=sys.stderr,
    )


def _skipped_with_itex(itex: dict | None, **empty) -> dict | None:
    """Return the status of a race left out because ITEX is loaded, else None.

    ITEX's kernels replace TensorFlow's, so TensorFlow's are not raced; and
    where its bfloat16 kernels abort the process a bfloat16 step would end
    the doctor. `empty` adds the race's own keys, empty.
    """
    if itex is None or not itex.get("importable"):
        return None
    return {
        "cache": None,
        "measured_now": False,
        "cells": [],
        **empty,
        "skipped": "ITEX is loaded: its kernels replace TensorFlow's",
    }


def layer_paths_status(seconds: float, itex: dict | None = None) -> dict:
    """Return the layers' measured graph-step paths, measuring them if needed.

    The measurement is cached per CPU model, TensorFlow version and oneDNN
    state (`keras_amp_plus.layers._path_calibration`); the doctor runs it
    once, the layers read it when a model is traced.

    Args:
        seconds: wall-time budget when the measurement has to run.
        itex: `itex_status()`. With ITEX loaded nothing is measured: its own
            kernels replace TensorFlow's, and where its bfloat16 kernels
            abort the process a bfloat16 step would end the doctor.

    Returns:
        `{"cache", "measured_now", "cells"}`, plus `"skipped"` (why) when
        nothing was measured on purpose.
    """
    from keras_amp_plus.layers import _path_calibration

    skipped = _skipped_with_itex(itex)
    if skipped is not None:
        return skipped

    path = _path_calibration.cache_path()
    cells = _path_calibration.cached_cells()
    measured_now = not cells
    if measured_now:
        cells = _path_calibration.measure_paths(seconds=seconds)["cells"]
    return {"cache": path, "measured_now": measured_now, "cells": cells}


# The jit probe gets this many times the probe budget: its steps take about
# 0.1 s in float32 on a 2-core Intel Xeon, 0.25 s in bfloat16 without XLA.
JIT_PROBE_BUDGET_FACTOR = 2

# The Swish sigmoid race gets this many times the probe budget: two passes
# over both precisions' sizes took about 30 s on an Intel Xeon Ice Lake.
SWISH_SIGMOID_BUDGET_FACTOR = 16


def swish_sigmoid_status(seconds: float, itex: dict | None = None) -> dict:
    """Return Swish's measured recompute thresholds inside XLA, measuring if needed.

    Cached per CPU model, TensorFlow version and oneDNN state
    (`keras_amp_plus.layers._swish_calibration`): the doctor races keeping
    and recomputing the sigmoid once for each input precision that has a
    threshold here, the layer reads the result when a model is traced.

    Args:
        seconds: wall-time budget when the measurement has to run.
        itex: `itex_status()`. With ITEX loaded nothing is measured (as for
            `layer_paths_status`).

    Returns:
        `{"cache", "measured_now", "cells", "thresholds"}` (`thresholds`:
        elements per dtype name), plus `"skipped"` (why) when nothing was
        measured on purpose.
    """
    from keras_amp_plus.layers import _swish_activation, _swish_calibration

    skipped = _skipped_with_itex(itex, thresholds={})
    if skipped is not None:
        return skipped
    thresholds = _swish_activation.sigmoid_thresholds()
    cells = _swish_calibration.cached_cells()
    measured_now = not cells  # float32 always has a threshold
    if measured_now:
        raced = list(thresholds)
        cells = _swish_calibration.measure_recompute(raced, seconds=seconds)["cells"]
        thresholds = _swish_activation.sigmoid_thresholds()
    return {
        "cache": _swish_calibration.cache_path(),
        "measured_now": measured_now,
        "cells": cells,
        "thresholds": thresholds,
    }


# The instance-norm sums race inside XLA gets this many times the probe
# budget: one pass over its 21 cells, Keras's program timed beside, took
# about 16 s on an Intel Xeon (AMX).
XLA_SUMS_BUDGET_FACTOR = 18


def xla_sums_status(seconds: float, itex: dict | None = None) -> dict:
    """Return instance norm's measured sums inside XLA, measuring if needed.

    Cached per CPU model, TensorFlow version, oneDNN state and allocator
    setting (`keras_amp_plus.layers._xla_sums_calibration`): the doctor
    races the batched products and Keras's formula once, the layer reads
    the result when a model XLA compiles is traced.

    Args:
        seconds: wall-time budget when the measurement has to run.
        itex: `itex_status()`. With ITEX loaded nothing is measured (as for
            `layer_paths_status`).

    Returns:
        `{"cache", "measured_now", "cells"}`, plus `"skipped"` (why) when
        nothing was measured on purpose.
    """
    from keras_amp_plus.layers import _xla_sums_calibration

    skipped = _skipped_with_itex(itex)
    if skipped is not None:
        return skipped
    cells = _xla_sums_calibration.cached_cells()
    measured_now = not cells
    if measured_now:
        cells = _xla_sums_calibration.measure_sums(seconds=seconds)["cells"]
    return {
        "cache": _xla_sums_calibration.cache_path(),
        "measured_now": measured_now,
        "cells": cells,
    }


def gather_facts(probe_seconds: float = 2.0, probe_size: int = 1024) -> dict:
    """Collect everything the doctor reports, including the recommendation.

    The probe's bfloat16 figure is cached on disk for `AMPMonitor`'s check
    (`keras_amp_plus._bfloat16_outlook.bfloat16_outlook`), and so are the layers'
    measured paths. The jit probe trains under the policy recommended.

    Args:
        probe_seconds: time budget of the matmul probe; the jit probe gets
            `JIT_PROBE_BUDGET_FACTOR` times it, and the layers' path
            measurement, Swish's sigmoid race and instance norm's sums race
            inside XLA, when not cached yet, `LAYER_PATHS_BUDGET_FACTOR`,
            `SWISH_SIGMOID_BUDGET_FACTOR` and `XLA_SUMS_BUDGET_FACTOR` times
            it. Defaults to `2.0`.
        probe_size: side of the probe's square matrices. Defaults to `1024`.

    Returns:
        A JSON-serializable dict with keys `"versions"`, `"onednn"`, `"cpu"`,
        `"devices"`, `"xla"`, `"probe"`, `"jit_probe"`, `"layer_paths"`,
        `"swish_sigmoid"`, `"xla_sums"` and `"recommendation"`.
    """
    from keras_amp_plus import _matmul_probe
    from keras_amp_plus.cli import _jit_probe

    stack = versions()
    cache = cache_status()
    if not stack["itex"].get("importable"):
        _say_first_measurement(cache)
    facts = {
        "versions": stack,
        "cache": cache,
        "onednn": onednn_status(),
        "cpu": cpu_status(),
        "devices": device_list(),
        "xla": fit_xla_status(),
        "probe": _matmul_probe.probe_matmul_throughput(
            probe_seconds, probe_size, dtypes=probe_dtypes(stack["itex"])
        ),
    }
    from keras_amp_plus import _bfloat16_outlook  # imports TensorFlow

    _bfloat16_outlook.bfloat16_outlook(probe=facts["probe"])  # caches the figure
    speedups = {
        dtype: result.get("speedup_vs_float32")
        for dtype, result in facts["probe"]["results"].items()
    }
    facts_for_advice = dict(
        features=facts["cpu"]["features"],
        onednn=facts["onednn"]["enabled"],
        fit_uses_xla=facts["xla"]["jit_compile"],
        onednn_env=facts["onednn"]["TF_ENABLE_ONEDNN_OPTS"],
        itex_bfloat16=stack["itex"].get("bfloat16"),
        allocator_env=os.environ.get(recommendation.ALLOCATOR_VARIABLE),
    )
    policy = recommendation.recommend(speedups, **facts_for_advice)["policy"]
    facts["jit_probe"] = _jit_probe.probe_jit_speedup(
        JIT_PROBE_BUDGET_FACTOR * probe_seconds, policy
    )
    facts["layer_paths"] = layer_paths_status(
        LAYER_PATHS_BUDGET_FACTOR * probe_seconds, stack["itex"]
    )
    facts["swish_sigmoid"] = swish_sigmoid_status(
        SWISH_SIGMOID_BUDGET_FACTOR * probe_seconds, stack["itex"]
    )
    facts["xla_sums"] = xla_sums_status(
        XLA_SUMS_BUDGET_FACTOR * probe_seconds, stack["itex"]
    )
    facts["recommendation"] = recommendation.recommend(
        speedups, jit_probe=facts["jit_probe"], **facts_for_advice
    )
    return facts


def main(json_output: bool = False, probe_seconds: float = 2.0) -> int:
    """Run the doctor, print text or JSON, and return the process exit code.

    Args:
        json_output: print JSON instead of text. Defaults to `False`.
        probe_seconds: time budget of the matmul probe. Defaults to `2.0`.

    Returns:
        0, or 1 when the stack cannot run keras_amp_plus (the problem, and
        the CPU facts that need no TensorFlow, on stderr).
    """
    if probe_seconds <= 0:
        raise ValueError(
            f"`probe_seconds` must be positive. Received: probe_seconds={probe_seconds}"
        )
    problems = stack_problems()
    if problems:
        for problem in problems:
            print(f"keras_amp_plus doctor: {problem}", file=sys.stderr)
        cpu = cpu_status()
        print(f"keras_amp_plus doctor: CPU: {json.dumps(cpu)}", file=sys.stderr)
        return 1
    facts = gather_facts(probe_seconds)
    print(json.dumps(facts, indent=2) if json_output else doctor_text.render(facts))
    return 0

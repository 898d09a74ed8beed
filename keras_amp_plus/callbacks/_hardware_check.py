"""Warn, once per process, when a bfloat16 model trains on a CPU where it is slow.

On CPUs without AMX-BF16/AVX512-BF16 (or with oneDNN off) TensorFlow emulates
bfloat16 and `mixed_bfloat16` trains slower than float32. The check is cheap:
the CPU flags decide, and the measured figure comes from the on-disk cache of
`keras_amp_plus._bfloat16_outlook.bfloat16_outlook` (a short probe runs once per
machine where no figure is cached yet, never once per `fit`).
"""

import logging

from keras_amp_plus import _bfloat16_outlook, _hardware
from keras_amp_plus._lists import layer_names

logger = logging.getLogger("keras_amp_plus")
_warned = []  # one entry once the warning was given in this process


def computes_in(model, dtype: str) -> bool:
    """Return True when the model or any of its layers computes in `dtype`."""
    layers = [model, *layer_names.candidate_layers(model)]
    return any(layer.dtype_policy.compute_dtype == dtype for layer in layers)


def low_precision_source(model, dtype: str, engine=None) -> str | None:
    """Say why `model` computes in `dtype`, or return None when it does not.

    A graph engine (grappler, ITEX) rewrites a float32-policy model's ops to
    its data type (grappler: bfloat16); otherwise the layers' policies decide.

    Args:
        model: the Keras model.
        dtype: `"bfloat16"` or `"float16"`.
        engine: the resolved engine. Defaults to None.
    """
    rewrite = None
    if engine is not None and engine.level == "op":
        rewrite = getattr(engine, "data_type", "BFLOAT16").lower()
    if rewrite == dtype:
        return f"engine {engine.name!r} rewrites its ops"
    return "its policy" if computes_in(model, dtype) else None


def warn_once_if_bfloat16_is_slow(model, engine=None) -> None:
    """Log a warning (once per process) if `model` uses bfloat16 where it is slow.

    Args:
        model: the Keras model about to be trained.
        engine: the resolved engine. Defaults to None. A graph engine
            computes in bfloat16 under a float32 policy.
    """
    if _warned:
        return
    source = low_precision_source(model, "bfloat16", engine)
    if source is None:
        return
    if _hardware.has_xpu():
        return  # the verdict is the CPU's; an Intel XPU computes instead
    outlook = _bfloat16_outlook.bfloat16_outlook()
    if outlook["verdict"] != "slower":
        return
    _warned.append(True)
    logger.warning(
        "AMPMonitor: model %r computes in bfloat16 (%s), but %s: bfloat16 "
        "will train slower than float32 on this machine. Train in float32 "
        "instead (`python -m keras_amp_plus doctor` explains the measurement).",
        model.name,
        source,
        outlook["reason"],
    )

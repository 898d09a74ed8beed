"""Warn, once per process, when a bfloat16 model trains on a CPU where it is slow.

On CPUs without AMX-BF16/AVX512-BF16 (or with oneDNN off) TensorFlow emulates
bfloat16 and `mixed_bfloat16` trains slower than float32. The check is cheap:
the CPU flags decide, and the measured figure comes from the on-disk cache of
`keras_amp_plus._hardware.bfloat16_outlook` (a short probe runs once per
machine where no figure is cached yet, never once per `fit`).
"""

import logging

from keras_amp_plus import _hardware
from keras_amp_plus._lists import layer_names

logger = logging.getLogger("keras_amp_plus")
_warned = []  # one entry once the warning was given in this process


def computes_in(model, dtype: str) -> bool:
    """Return True when the model or any of its layers computes in `dtype`."""
    layers = [model, *layer_names.candidate_layers(model)]
    return any(layer.dtype_policy.compute_dtype == dtype for layer in layers)


def warn_once_if_bfloat16_is_slow(model) -> None:
    """Log a warning (once per process) if `model` uses bfloat16 where it is slow.

    Args:
        model: the Keras model about to be trained.
    """
    if _warned or not computes_in(model, "bfloat16"):
        return
    outlook = _hardware.bfloat16_outlook()
    if outlook["verdict"] != "slower":
        return
    _warned.append(True)
    logger.warning(
        "AMPMonitor: model %r computes in bfloat16, but %s: mixed_bfloat16 "
        "will train slower than float32 on this machine. Train in float32 "
        "instead (`python -m keras_amp_plus doctor` explains the measurement).",
        model.name,
        outlook["reason"],
    )

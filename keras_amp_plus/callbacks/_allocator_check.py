"""Warn, once per process, where TensorFlow's CPU allocator does not pool memory.

With oneDNN off (TensorFlow's default on CPUs without AVX-512) and
`TF_CPU_ALLOCATOR_USE_BFC` unset, TensorFlow takes CPU tensors from malloc,
and glibc maps large ones afresh and page-faults them in at every step:
steps on large tensors, Keras's layers' and ours, run slower than with the
BFC allocator, and whether a layer's larger temporaries hit it depends on
what the process freed before (`benchmarks/README.md`). TensorFlow reads the
variable at start-up, so the monitor cannot set it, only say so before the
first step.
"""

import logging

from keras_amp_plus import _compat, _hardware

logger = logging.getLogger("keras_amp_plus")
_warned = []  # one entry once the warning was given in this process


def warn_once_if_allocator_unpooled() -> None:
    """Log a warning (once per process) where CPU tensors come from malloc.

    Not with ITEX loaded (its own allocator takes them) or on an Intel XPU
    (the model's tensors live on the device).

    Example:
    >>> warn_once_if_allocator_unpooled()  # logs to "keras_amp_plus" at most once
    """
    if _warned or not _hardware.allocator_unpooled(_compat.onednn_enabled()):
        return
    if _compat.itex_module() is not None or _hardware.has_xpu():
        return
    _warned.append(True)
    logger.warning(
        "AMPMonitor: TensorFlow's oneDNN is off here and %s is unset, so "
        "TensorFlow allocates CPU tensors with malloc, which maps tensors of "
        "16 MiB and more afresh (and page-faults them in) at every step: "
        "training steps on large tensors run slower than they need to. Set "
        "%s=1 in the environment before TensorFlow is imported "
        "(`python -m keras_amp_plus doctor` measures this machine).",
        _hardware.ALLOCATOR_VARIABLE,
        _hardware.ALLOCATOR_VARIABLE,
    )

"""Which implementation a normalization runs at a shape, on this CPU.

Two implementations compute the same result with float32 statistics: the
fused XLA kernels (`_fused_normalization`) and Keras's own formula
(`_keras_formula`). Which one is faster depends on where the layer runs, on
the shape and on the CPU, as measured by `benchmarks/layers.py` on each kind
of machine:

- In a step XLA compiles whole (`jit_compile=True`), XLA fuses Keras's
  formula with its neighbours, and the kernels' functions are only inlined
  into the model's cluster: they win there only for statistics over trailing
  axes (layer norm) whose sums run as matrix products (from
  `DOT_SUM_MIN_ELEMENTS` on). Everywhere else inside XLA, Keras's formula.
- In a graph step (no XLA around), from `DOT_SUM_MIN_ELEMENTS` on the
  kernels win on every CPU measured. Below it the race is close and differs
  between CPUs: where `_path_calibration` measured it on this CPU model and
  TensorFlow version (the doctor runs it), the measured winner; otherwise
  the rule from CPU features: the kernels for statistics over trailing axes
  on CPUs with AVX-512 (the Intel Xeon measurements), Keras's formula on
  CPUs without (the AMD EPYC measurements of issue 10: the kernels were
  1.1-1.8x slower there) and for statistics over middle axes (instance
  norm: XLA's reductions over them are slower than TensorFlow's).
- With TensorFlow's graph-level bfloat16 rewrite on, always the kernels:
  the rewrite would turn the formula's statistics ops to bfloat16, and it
  leaves XLA-compiled functions alone.

`KERAS_AMP_PLUS_NORMALIZATION_PATH` (`auto`, the default, `fused_kernels` or
`keras_formula`), read when a function is traced, overrides the choice.
"""

import functools
import os

import tensorflow as tf

from keras_amp_plus import _compat, _hardware
from keras_amp_plus.layers import _path_calibration

FUSED_KERNELS = _path_calibration.FUSED_KERNELS
KERAS_FORMULA = _path_calibration.KERAS_FORMULA
PATH_VARIABLE = "KERAS_AMP_PLUS_NORMALIZATION_PATH"

# Below this many elements XLA's CPU backend emits a (rows, n) x (n, 1) dot as
# a single-threaded loop, slower than a plain reduction; from it on a dot is
# one call into a vectorized GEMM (see `benchmarks/results/layers_*.json`).
DOT_SUM_MIN_ELEMENTS = 2**22

# TensorFlow's graph rewrites that would paint the formula's statistics.
_GRAPH_REWRITES = (
    "auto_mixed_precision_onednn_bfloat16",
    "auto_mixed_precision_mkl",
    "auto_mixed_precision",
)


@functools.cache
def cpu_has_avx512() -> bool:
    """Return True when this CPU lists AVX-512 (unknown CPUs count as not)."""
    text = _hardware.read_cpuinfo()
    return text is not None and "avx512f" in _hardware.parse_cpu_flags(text)


def graph_rewrite_on() -> bool:
    """Return True when a grappler mixed-precision rewrite is switched on."""
    options = tf.config.optimizer.get_experimental_options()
    return any(options.get(name) for name in _GRAPH_REWRITES)


def _forced_path():
    value = os.environ.get(PATH_VARIABLE, "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in (FUSED_KERNELS, KERAS_FORMULA):
        raise ValueError(
            f"`{PATH_VARIABLE}` must be 'auto', '{FUSED_KERNELS}' or "
            f"'{KERAS_FORMULA}'. Unset it to let the layers choose. "
            f"Received: {PATH_VARIABLE}={value!r}"
        )
    return value


def normalization_path(elements, trailing_statistics=True, dtype="float32") -> str:
    """Return `FUSED_KERNELS` or `KERAS_FORMULA` for an input of `elements`.

    Args:
        elements: the input's number of elements, or None when unknown at
            trace time (variable shapes: the kernels, padded to row buckets).
        trailing_statistics: whether the statistics are taken over the
            input's trailing axes (layer norm) rather than middle ones
            (instance norm). Defaults to `True`.
        dtype: the input's dtype, for the measured choice. Defaults to
            `"float32"`.

    Returns:
        The implementation to run, chosen as the module docstring says.

    Example:
    >>> normalization_path(None)
    'fused_kernels'
    """
    forced = _forced_path()
    if forced is not None:
        return forced
    large = elements is not None and elements >= DOT_SUM_MIN_ELEMENTS
    if _compat.in_xla_compiled_function():
        if trailing_statistics and (elements is None or large):
            return FUSED_KERNELS
        return KERAS_FORMULA
    if elements is None or large:
        return FUSED_KERNELS
    if tf.executing_eagerly() or graph_rewrite_on():
        return FUSED_KERNELS
    measured = _path_calibration.measured_path(elements, trailing_statistics, dtype)
    if measured is not None:
        return measured
    if trailing_statistics and cpu_has_avx512():
        return FUSED_KERNELS
    return KERAS_FORMULA

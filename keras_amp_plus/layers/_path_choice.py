"""Which implementation a normalization runs at a shape, on this CPU.

Three implementations (four paths) compute the same result with float32
statistics: the fused XLA kernels (`_fused_normalization`), Keras's own formula
(`_keras_formula`) and, for instance norm, TensorFlow's fused batch-norm
kernel, on the whole batch transposed (`_batch_norm_formula`) or, for large
samples, per sample (`_per_sample_batch_norm`, a fourth path). Which one is
faster depends on where the layer runs, on the shape and on the CPU, as
measured by `benchmarks/layers.py` on each kind of machine:

- In a step XLA compiles whole (`jit_compile=True`), XLA fuses Keras's
  formula with its neighbours, and the kernels' functions are only inlined
  into the model's cluster. For statistics over trailing axes (layer norm)
  the kernels still win there at every size, their sums being matrix
  products. For statistics over middle axes (instance norm), Keras's
  formula, its sums batched products where they beat its reductions on
  this machine (`_keras_formula`, `_xla_sums_calibration`).
- In a graph step (no XLA around), for statistics over trailing axes from
  `DOT_SUM_MIN_ELEMENTS` on, the kernels, which won on every CPU measured.
  Elsewhere the race is close and differs between CPUs and dtypes: where
  `_path_calibration` measured it on this CPU model and TensorFlow version
  (the doctor runs it), the measured winner. Otherwise a rule: from
  `DOT_SUM_MIN_ELEMENTS` on, the kernels; below it, for statistics over
  trailing axes (layer norm), the kernels; for statistics over middle
  axes (instance norm, channels last), TensorFlow's fused batch-norm kernel
  from `BATCH_NORM_MIN_ELEMENTS` on (per sample from
  `PER_SAMPLE_MIN_ELEMENTS` on, where that applies) and Keras's formula
  below; with TensorFlow's oneDNN kernels off, float32 instance norms run
  Keras's formula (it won every race there but the next rule's).
- Instance norms of samples of `LARGE_SAMPLE_ELEMENTS` or more, in either
  kind of graph step, run per sample, measured or not, oneDNN on or off.
- In a graph step traced with an unknown batch size (as `fit` traces a
  `tf.data` pipeline without `drop_remainder`, or a partial last batch), the
  winner measured in steps traced that way for each batch size
  (`paths_by_batch_size`), switched at run time; there the kernels are the
  safe side (`_path_calibration.safe_path`; Keras's formula for small
  instance norms, TensorFlow's batch-norm kernel for large ones, per sample
  where that applies) and run
  where nothing was measured (unless the nearest measurement timed it slower
  than Keras's formula: then the formula; and float32 instance norms with
  oneDNN off run the formula, as in steps of a known batch size), or where
  other sizes vary too (row buckets).
- In a graph step traced for any image size (an instance norm whose sample
  size is unknown at trace time), per sample from `LARGE_SAMPLE_ELEMENTS`
  elements a sample, below it the winners measured in steps of any batch
  size for the input's size (`paths_by_sample_size`), switched at run time.
  A forced `per_sample_batch_norm` runs per sample there at every size.
- float16 instance norms in graph steps on a CPU without float16 arithmetic
  (no AVX512-FP16 or AMX-FP16) run in float32, the input widened once, and
  so follow float32's measurements and rules: every float16 operation there
  is a float32 one rounded back, and XLA's kernels converted float16 values
  one by one, which made them slower than Keras's layer at most shapes of
  the grid. With float16 arithmetic, float16
  follows bfloat16's measurements, but takes the batch-norm kernel where
  the kernels won them narrowly (`_path_calibration.float16_path`).
- With TensorFlow's graph-level bfloat16 rewrite on, always the kernels:
  the rewrite would turn the formula's statistics ops to bfloat16, and it
  leaves XLA-compiled functions alone.

`KERAS_AMP_PLUS_NORMALIZATION_PATH` (`auto`, the default, `fused_kernels`,
`keras_formula`, `batch_norm` or `per_sample_batch_norm`), read when a
function is traced, overrides the choice (`per_sample_batch_norm` where it
applies outside XLA, else as `batch_norm`; `batch_norm` where it applies
outside XLA, else the kernels).
"""

import functools
import os

import tensorflow as tf

from keras_amp_plus import _compat
from keras_amp_plus.layers import (
    _path_calibration,
    _per_sample_batch_norm,
    _precision,
)

FUSED_KERNELS = _path_calibration.FUSED_KERNELS
KERAS_FORMULA = _path_calibration.KERAS_FORMULA
BATCH_NORM = _path_calibration.BATCH_NORM
PER_SAMPLE_BATCH_NORM = _path_calibration.PER_SAMPLE_BATCH_NORM
_PATHS = (FUSED_KERNELS, KERAS_FORMULA, BATCH_NORM, PER_SAMPLE_BATCH_NORM)

# Without a measurement, instance norm (in a graph step, below the dot size)
# runs TensorFlow's batch-norm kernel from these sizes on: half-width inputs
# (bfloat16; float16 where the CPU has float16 arithmetic, else as float32)
# and float32 inputs (float32 with oneDNN on only).
BATCH_NORM_MIN_ELEMENTS = {"half": 2**18, "float32": 2**21}
# ... and per sample from this size on, where that applies: below it the
# transposed layout was as fast or faster (samples of 2**17 elements).
PER_SAMPLE_MIN_ELEMENTS = 2**21
# Samples larger than any the path measurement races (2**18 elements, at
# 8x64x64x64) take the per-sample path whatever the measurements of inputs
# of their total size say: at 2**19 elements per sample (32x64x64x128) it ran
# 0.20-0.57x Keras's layer and at most 0.7x the next best path's time (graph
# and tf.data steps, all three dtypes, oneDNN on and off, on an AMD EPYC
# Zen 4; `benchmarks/paths.py`), while the nearest measured cells, of 2**17
# elements per sample where the race is close, had chosen the kernels.
LARGE_SAMPLE_ELEMENTS = 2**19
PATH_VARIABLE = "KERAS_AMP_PLUS_NORMALIZATION_PATH"

# From this many elements on, layer norm's kernels win on every CPU measured,
# also without AVX-512 (see `benchmarks/results/layers_*.json`), and instance
# norm's kernels are the rule's choice where nothing was measured.
DOT_SUM_MIN_ELEMENTS = 2**22

# TensorFlow's graph rewrites that would paint the formula's statistics.
_GRAPH_REWRITES = (
    "auto_mixed_precision_onednn_bfloat16",
    "auto_mixed_precision_mkl",
    "auto_mixed_precision",
)


def graph_rewrite_on() -> bool:
    """Return True when a grappler mixed-precision rewrite is switched on."""
    options = tf.config.optimizer.get_experimental_options()
    return any(options.get(name) for name in _GRAPH_REWRITES)


def _forced_path():
    value = os.environ.get(PATH_VARIABLE, "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in _PATHS:
        raise ValueError(
            f"`{PATH_VARIABLE}` must be 'auto', '{FUSED_KERNELS}', "
            f"'{KERAS_FORMULA}', '{BATCH_NORM}' or '{PER_SAMPLE_BATCH_NORM}' "
            "(the last two: instance norm, channels last). Unset it to let the "
            "layers choose. "
            f"Received: {PATH_VARIABLE}={value!r}"
        )
    return value


def path_is_forced() -> bool:
    """Return whether `KERAS_AMP_PLUS_NORMALIZATION_PATH` names a path.

    Example:
    >>> import os
    >>> path_is_forced() == (os.environ.get(PATH_VARIABLE, "auto") != "auto")
    True
    """
    return _forced_path() is not None


def normalization_path(
    elements,
    trailing_statistics=True,
    dtype="float32",
    batch_norm_applies=False,
    per_sample_applies=False,
) -> str:
    """Return the path (`FUSED_KERNELS`, `KERAS_FORMULA`, ...) of an input.

    Args:
        elements: the input's number of elements, or None when unknown at
            trace time (variable shapes: the kernels, padded to row buckets
            where that applies; instance norms of any image size are chosen
            by `paths_by_sample_size` instead).
        trailing_statistics: whether the statistics are taken over the
            input's trailing axes (layer norm) rather than middle ones
            (instance norm). Defaults to `True`.
        dtype: the input's dtype, for the measured choice. Defaults to
            `"float32"`.
        batch_norm_applies: whether the input can take `BATCH_NORM`
            (`_batch_norm_formula.applies`). Defaults to `False`.
        per_sample_applies: whether the input can take
            `PER_SAMPLE_BATCH_NORM` (`_per_sample_batch_norm.applies`).
            Defaults to `False`.

    Returns:
        The implementation to run, chosen as the module docstring says.

    Example:
    >>> normalization_path(None)
    'fused_kernels'
    """
    fixed = _path_without_size(
        elements, trailing_statistics, batch_norm_applies, per_sample_applies
    )
    if fixed is not None:
        return fixed
    if elements is None:  # variable lengths: the kernels, in row buckets
        return FUSED_KERNELS
    return _graph_step_path(
        elements,
        trailing_statistics,
        dtype,
        batch_norm_applies,
        per_sample_applies=per_sample_applies,
    )


def paths_by_batch_size(
    shape,
    trailing_statistics=True,
    dtype="float32",
    batch_norm_applies=False,
    per_sample_applies=False,
) -> tuple:
    """Return the path for each range of batch sizes of inputs of `shape`.

    In a graph step `fit` traces, the batch size is often unknown (a
    `tf.data` pipeline without `drop_remainder`, a partial last batch), while
    the measured winner depends on the input's size. Then the choice is made
    per batch size, from the winners measured in steps traced that way (the
    kernels where none were), and the layer switches between the paths at
    run time (`_size_switch`). Elsewhere (a known shape, XLA, a forced
    path, ...) it is one path for every size.

    Args:
        shape: the input's static shape (`tf.TensorShape` or tuple).
        trailing_statistics: as in `normalization_path`. Defaults to `True`.
        dtype: as in `normalization_path`. Defaults to `"float32"`.
        batch_norm_applies: as in `normalization_path`. Defaults to `False`.
        per_sample_applies: as in `normalization_path`. Defaults to
            `False`.

    Returns:
        A tuple of `(first batch size, path)` pairs, by increasing batch size,
        each path differing from the one before; the first starts at 1.

    Example:
    >>> paths_by_batch_size((4, 16))
    ((1, 'fused_kernels'),)
    """
    shape = tf.TensorShape(shape)
    sample = tf.TensorShape(shape[1:]).num_elements() if shape.rank else None
    if per_sample_applies and sample >= LARGE_SAMPLE_ELEMENTS:
        fixed = _path_without_size(
            shape.num_elements(),
            trailing_statistics,
            batch_norm_applies,
            per_sample_applies,
        )
        return ((1, fixed or PER_SAMPLE_BATCH_NORM),)
    if shape.num_elements() is not None or not sample:
        elements = shape.num_elements()
        path = normalization_path(
            elements, trailing_statistics, dtype, batch_norm_applies, per_sample_applies
        )
        return ((1, path),)
    fixed = _path_without_size(
        None, trailing_statistics, batch_norm_applies, per_sample_applies
    )
    if fixed is not None:
        return ((1, fixed),)
    return _runs(
        _batch_size_grid(),
        lambda batch: _graph_step_path(
            batch * sample,
            trailing_statistics,
            dtype,
            batch_norm_applies,
            unknown_batch=True,
            per_sample_applies=per_sample_applies,
        ),
    )


def paths_by_sample_size(dtype="float32", batch_norm_applies=False) -> tuple:
    """Return the paths of an instance norm whose sample size is unknown.

    A fully convolutional model (`keras.Input((None, None, C))`) traces its
    step for any image size, so neither the sample size nor the input's
    size is known at trace time, and both decide the path: per sample from
    `LARGE_SAMPLE_ELEMENTS` elements per sample on (as for a known shape,
    measured or not); below it, the winner measured for the input's size in
    steps traced for any batch size, where the per-sample path competes from
    `_per_sample_batch_norm.MIN_SAMPLE_ELEMENTS` on; the rules where nothing
    was measured. The layer switches between them at run time
    (`_size_switch.switch_on_sample_size`).

    Args:
        dtype: as in `normalization_path`. Defaults to `"float32"`.
        batch_norm_applies: as in `normalization_path`; the per-sample path
            applies with it. Defaults to `False`.

    Returns:
        A tuple of `(first sample elements, runs)` pairs by increasing
        sample size, the first starting at 1; each `runs` a tuple of
        `(first elements, path)` pairs by increasing input size, as
        `paths_by_batch_size` returns them.

    Example:
    >>> paths_by_sample_size()  # float64 or a tiny epsilon: the kernels
    ((1, ((1, 'fused_kernels'),)),)
    """
    fixed = _path_without_size(None, False, batch_norm_applies, batch_norm_applies)
    if fixed is not None or not batch_norm_applies:
        return ((1, ((1, fixed or FUSED_KERNELS),)),)
    return (
        (1, _runs_by_elements(dtype, per_sample_applies=False)),
        (
            _per_sample_batch_norm.MIN_SAMPLE_ELEMENTS,
            _runs_by_elements(dtype, per_sample_applies=True),
        ),
        (LARGE_SAMPLE_ELEMENTS, ((1, PER_SAMPLE_BATCH_NORM),)),
    )


def _runs_by_elements(dtype, per_sample_applies) -> tuple:
    """Return `(first elements, path)` runs of instance norms of any size."""
    return _runs(
        _element_grid(),
        lambda elements: _graph_step_path(
            elements,
            False,
            dtype,
            batch_norm_applies=True,
            unknown_batch=True,
            per_sample_applies=per_sample_applies,
        ),
    )


def _runs(sizes, path_at) -> tuple:
    """Return `(first size, path)` runs of `path_at` over the increasing `sizes`.

    Each run starts where the path changes; the first at 1.
    """
    runs = []
    for size in sizes:
        path = path_at(size)
        if not runs or runs[-1][1] != path:
            runs.append((size if runs else 1, path))
    return tuple(runs)


@functools.cache
def _element_grid() -> tuple:
    """Input sizes the choice is evaluated at: 1 to 2**30, 9% apart."""
    return tuple(sorted({round(2 ** (k / 8)) for k in range(8 * 30 + 1)}))


@functools.cache
def _batch_size_grid() -> tuple:
    """Batch sizes the choice is evaluated at: each up to 64, then 9% apart.

    The choice depends on the size through thresholds and the nearest
    measured size (octaves apart), so a finer grid changes nothing measurable.
    """
    geometric = {round(2 ** (k / 8)) for k in range(48, 8 * 20 + 1)}
    return tuple(sorted(set(range(1, 65)) | geometric))


def _float32_without_onednn(dtype) -> bool:
    """Return True for float32 (or wider) inputs with TensorFlow's oneDNN off."""
    return tf.as_dtype(dtype).size >= 4 and _compat.onednn_enabled() is False


def _path_without_size(
    elements, trailing_statistics, batch_norm_applies, per_sample_applies=False
):
    """Return the path where the input's size does not decide it, else None.

    That is a forced path, any step inside XLA, a large layer norm, eager
    execution and a graph-level bfloat16 rewrite.
    """
    forced = _forced_path()
    in_xla = _compat.in_xla_compiled_function()
    if forced == PER_SAMPLE_BATCH_NORM and (in_xla or not per_sample_applies):
        forced = BATCH_NORM
    # XLA's lowering of the batch-norm kernel on the reshaped (sample,
    # channel) layout gave wrong results: never inside XLA.
    if forced == BATCH_NORM and (in_xla or not batch_norm_applies):
        forced = FUSED_KERNELS
    if forced is not None:
        return forced
    large = elements is not None and elements >= DOT_SUM_MIN_ELEMENTS
    if in_xla:
        return FUSED_KERNELS if trailing_statistics else KERAS_FORMULA
    if large and trailing_statistics:
        return FUSED_KERNELS
    if tf.executing_eagerly() or graph_rewrite_on():
        return FUSED_KERNELS
    return None


def _graph_step_path(
    elements,
    trailing_statistics,
    dtype,
    batch_norm_applies,
    unknown_batch=False,
    per_sample_applies=False,
):
    """Return the path of a graph step for an input of `elements` elements.

    `unknown_batch`: the step was traced for any batch size (the winners
    measured in such steps apply).
    """
    large = elements >= DOT_SUM_MIN_ELEMENTS
    if large and trailing_statistics:
        return FUSED_KERNELS
    applies = (batch_norm_applies, per_sample_applies)
    if not trailing_statistics and _precision.emulated_float16(dtype):
        # Every path computes it in float32, the input widened once (the
        # kernels: `_fused_normalization._kernels_input`), as float32 does.
        dtype = tf.float32
    unavailable = () if per_sample_applies else (PER_SAMPLE_BATCH_NORM,)
    measured = _path_calibration.measured_path(
        elements, trailing_statistics, dtype, unknown_batch, unavailable=unavailable
    )
    if measured == BATCH_NORM and not batch_norm_applies:
        measured = None
    if measured is not None:
        return measured
    if not trailing_statistics and _float32_without_onednn(dtype):
        # Keras's formula beat the kernels and TensorFlow's batch-norm kernel
        # there in every race, in both kinds of step.
        return KERAS_FORMULA
    if unknown_batch:  # the safe side of such steps' measurements
        path = _path_calibration.unmeasured_path(
            elements, trailing_statistics, dtype, batch_norm_applies, unavailable
        )
        # The batch-norm kernel's side (from 2**22 elements): per sample, a
        # loop, beat the transposed batch there in every dtype measured.
        per_sample = path == BATCH_NORM and per_sample_applies
        return PER_SAMPLE_BATCH_NORM if per_sample else path
    if large and per_sample_applies:  # it beat the kernels there, oneDNN on and off
        return PER_SAMPLE_BATCH_NORM
    if large or trailing_statistics:
        return FUSED_KERNELS
    width = "float32" if tf.as_dtype(dtype).size >= 4 else "half"
    return _batch_norm_or_formula(elements, *applies, width)


def _batch_norm_or_formula(elements, batch_norm_applies, per_sample_applies, width):
    """Return the batch-norm kernel from `BATCH_NORM_MIN_ELEMENTS[width]` on.

    Per sample from `PER_SAMPLE_MIN_ELEMENTS` on where that applies, else
    on the whole batch; Keras's formula below that size.
    """
    if not batch_norm_applies or elements < BATCH_NORM_MIN_ELEMENTS[width]:
        return KERAS_FORMULA
    if per_sample_applies and elements >= PER_SAMPLE_MIN_ELEMENTS:
        return PER_SAMPLE_BATCH_NORM
    return BATCH_NORM

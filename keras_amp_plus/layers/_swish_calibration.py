"""Measured sigmoid choice for Swish inside XLA: once per CPU model and TensorFlow.

Inside a step XLA compiles whole, Swish's backward pass either reads the
sigmoid kept from the forward pass (a float32 or wider input's: off the
output, one division; a half-precision one's: a float32 tensor written and
read once more) or recomputes it from the input (one more exponential per
element). From which size recomputing pays depends on the CPU: for float32
two CPUs measured thresholds two octaves apart when float32 kept a copy of
its own (`benchmarks/swish_xla.py`, `benchmarks/README.md`).
`measure_recompute`
times both forms at a few sizes per input precision that has a threshold on
this machine (`_swish_activation._recompute_threshold`), forward + backward,
interleaved, medians of process CPU time, in two passes (as the paths'
race), and caches the ratios in
`keras_amp_plus._hardware.cache_dir()` beside the normalization paths' race
(`_path_calibration.cache_file`). `recompute_threshold` reads them back;
without a measurement the layer's own table applies.
"""

import tensorflow as tf

from keras_amp_plus.layers import _path_calibration, _ratio_race

# One octave apart around the thresholds measured so far (2**19 to 2**23).
RACED_SHAPES = ((512, 1024), (1024, 1024), (1024, 2048), (2048, 2048), (4096, 2048))
# Recomputing must take less than this share of keeping's time to count as a
# win at a size, and keeping less than this share of recomputing's: a median
# of a few calls moves by a few percent. Between, the table's choice stands.
CLEAR_WIN = 0.95
# Part of the cache file's name: raise it when either raced form or the way
# they are timed changes.
REVISION = 4
# The threshold of a precision whose sigmoid is kept at every size: more
# elements than any tensor holds.
NEVER = 2**62


def cache_path() -> str:
    """Return the cache file of this CPU model, TensorFlow and oneDNN state."""
    return _path_calibration.cache_file(f"swish_sigmoid_r{REVISION}")


def cached_cells() -> list:
    """Return the measurements cached for this machine (empty when none)."""
    return list(_path_calibration.read_cells(cache_path()))


def recompute_threshold(dtype_name: str, default: int) -> int:
    """Return the size from which Swish recomputes the sigmoid inside XLA.

    The smallest raced size from which recomputing won at every raced size
    above it; below the smallest raced size the table's `default` where
    recomputing won from there; `NEVER` where keeping won at the largest
    raced size (the trend goes on past it: on an Intel Xeon with oneDNN
    off, keeping won at the largest raced size and by more at four times
    it). A size where neither form won by `CLEAR_WIN` takes the table's
    choice.

    Args:
        dtype_name: the input's dtype name, a key of
            `_swish_activation.RECOMPUTE_SIGMOID_MIN_ELEMENTS`.
        default: that table's threshold.

    Returns:
        The threshold, in elements: `default` without a measurement.

    Example:
    >>> import os, tempfile
    >>> os.environ["KERAS_AMP_PLUS_CACHE_DIR"] = tempfile.mkdtemp()
    >>> recompute_threshold("float32", 2**22)
    4194304
    >>> del os.environ["KERAS_AMP_PLUS_CACHE_DIR"]
    """
    cells = [cell for cell in cached_cells() if cell["dtype"] == dtype_name]
    if not cells:
        return default
    cells.sort(key=lambda cell: cell["elements"])
    threshold = None
    for cell in reversed(cells):
        if not _recomputes(cell, default):
            break
        threshold = cell["elements"]
    if threshold is None:
        return NEVER
    if threshold == cells[0]["elements"]:
        return min(default, threshold)
    return threshold


def _recomputes(cell, default) -> bool:
    """Return whether recomputing is the choice at `cell`'s size."""
    ratio = cell["ratio"]  # recomputing's time over keeping's
    if ratio < CLEAR_WIN:
        return True
    if ratio > 1.0 / CLEAR_WIN:
        return False
    return cell["elements"] >= default


def measure_recompute(
    dtype_names, seconds: float = 10.0, reps: int = 7, passes: int = 2
) -> dict:
    """Race keeping and recomputing the sigmoid inside XLA and cache the ratios.

    Runs eagerly (never inside a `tf.function`). Cells are measured per
    dtype, smallest first, then again, `passes` times in all, until
    `seconds` of wall time are spent (`_ratio_race.race_ratio_cells`);
    a cell's ratio is the geometric mean over its passes. The cells done are
    cached.

    Args:
        dtype_names: the input dtypes to race (names).
        seconds: wall-time budget. Defaults to `10.0`.
        reps: interleaved calls per form and cell in each pass. Defaults to
            `7`.
        passes: how many times each cell is raced at most. Defaults to `2`.

    Returns:
        `{"path": cache file, "cells": [{"dtype", "shape", "elements",
        "ratio" (recomputing's CPU time / keeping's), "passes"}]}`.
    """
    specs = [(name, shape) for name in dtype_names for shape in RACED_SHAPES]
    return _ratio_race.race_ratio_cells(
        "measure_recompute",
        specs,
        lambda dtype_name, shape: _recompute_ratio(dtype_name, shape, reps),
        cache_path(),
        seconds,
        passes,
    )


def _recompute_ratio(dtype_name, shape, reps) -> float:
    """Return recomputing's median CPU time over keeping's, one pass."""
    steps = {
        recompute: _xla_step(shape, dtype_name, recompute)
        for recompute in (False, True)
    }
    medians = _path_calibration.time_interleaved(steps, reps)
    return medians[True] / medians[False]


def _xla_step(shape, dtype_name, recompute):
    """Return a `jit_compile=True` forward + backward step of one form."""
    from keras_amp_plus.layers import _swish_activation

    x, upstream = _path_calibration.raced_inputs(shape, dtype_name)
    beta = tf.constant(1.0, tf.float32)

    @tf.function(jit_compile=True)
    def step(x, upstream):
        with tf.GradientTape() as tape:
            tape.watch(x)
            # A Python bool, as the layer passes for a size known at trace
            # time: each form's program alone.
            outputs = _swish_activation._swish_choosing_backward_sigmoid(
                x, beta, False, recompute
            )
        # The outputs too, as the next layer reads them: without them XLA
        # fuses the forward's sigmoid into the backward and both forms agree.
        return outputs, tape.gradient(outputs, x, output_gradients=upstream)

    return lambda: step(x, upstream)

"""Measured sums for instance norm inside XLA: once per CPU model and TensorFlow.

Inside a step XLA compiles whole, instance norm channels last either takes
its per-sample sums as batched matrix products with a ones row
(`_product_means`, analytic gradient) or runs Keras's formula with
reductions, differentiated by autodiff (what XLA fuses with its
neighbours, as it fuses Keras's `GroupNormalization`). The products win
where XLA's CPU backend emits the fused reductions as scalar loops, most of
the layer grid on every CPU measured, but they write a float32 copy of a
half-precision input, which costs more than it saves at small inputs, and,
with TensorFlow's unpooled CPU allocator (oneDNN off, no
`TF_CPU_ALLOCATOR_USE_BFC`), at large ones, whose copy is mapped and
page-faulted in afresh every step (`benchmarks/in_xla_sums.py`) or not,
depending on what the process freed before: a race cannot settle that case,
which `AMPMonitor` and the doctor warn about instead.
`measure_sums` races both forms at instance-norm sizes per input precision,
forward + backward, interleaved with Keras's own instance norm (as a model's
other layers run between), medians of process CPU time, in two passes
(as the paths' race), and caches the ratios beside the normalization
paths' race (`_path_calibration.cache_file`), keyed also by the allocator
setting. `products_win` reads them back; without a measurement near the
input's size the products run.
"""

import math
import os

import tensorflow as tf

from keras_amp_plus import _hardware
from keras_amp_plus.layers import _path_calibration, _ratio_race

# The graph-step race's instance-norm shapes: 2**16 to 2**22 elements.
RACED_SHAPES = _path_calibration.MIDDLE_SHAPES
DTYPES = ("float32", "bfloat16", "float16")
# Part of the cache file's name: raise it when either raced form or the way
# they are timed changes.
REVISION = 2
# TensorFlow reads this at start-up: pooled or not, its large temporaries
# cost differently, so the race is cached per setting.
ALLOCATOR_VARIABLE = _hardware.ALLOCATOR_VARIABLE
# A measurement stands for inputs up to this many octaves of elements away.
# Not two, as in the paths' race: with oneDNN off and the unpooled allocator
# the products lost at 2**22 elements in half precision (1.3-1.4x the
# formula's time) and won at 2**24 (0.6-0.7x), where the formula's own
# temporaries page-fault too.
NEAREST_OCTAVES = 1.0
_STAT_AXES = (1, 2)


def cache_path() -> str:
    """Return the cache file of this CPU, TensorFlow, oneDNN and allocator."""
    allocator = os.environ.get(ALLOCATOR_VARIABLE, "unset").strip().lower() or "unset"
    return _path_calibration.cache_file(f"xla_sums_r{REVISION}_bfc-{allocator}")


def cached_cells() -> list:
    """Return the measurements cached for this machine (empty when none)."""
    return list(_path_calibration.read_cells(cache_path()))


def measured_in(dtype) -> bool:
    """Return whether the race measured inputs of `dtype` on this machine."""
    name = tf.as_dtype(dtype).name
    return any(cell["dtype"] == name for cell in cached_cells())


def products_win(dtype, elements) -> bool:
    """Return whether the products are the choice for an input inside XLA.

    The cell of the input's precision measured nearest its size decides,
    within `NEAREST_OCTAVES` octaves: the products where
    they took less CPU time than the formula there. Without such a cell the
    products, the faster form at most sizes measured. For a size unknown at
    trace time, `products_win_at_run_time`.

    Args:
        dtype: the input's dtype.
        elements: the input's number of elements, or None when unknown
            (then the products).

    Returns:
        True for the products, False for Keras's formula.

    Example:
    >>> import os, tempfile
    >>> os.environ["KERAS_AMP_PLUS_CACHE_DIR"] = tempfile.mkdtemp()
    >>> products_win("bfloat16", 2**20)
    True
    >>> del os.environ["KERAS_AMP_PLUS_CACHE_DIR"]
    """
    name = tf.as_dtype(dtype).name
    cells = [cell for cell in cached_cells() if cell["dtype"] == name]
    if elements is None or not cells or elements < 1:
        return True  # an empty input: nothing to sum either way
    nearest = min(cells, key=lambda cell: abs(math.log2(cell["elements"] / elements)))
    if abs(math.log2(nearest["elements"] / elements)) > NEAREST_OCTAVES:
        return True
    return nearest["ratio"] < 1.0


def products_win_at_run_time(dtype, elements):
    """Return `products_win` as a boolean tensor, for a size known at run time.

    Built from constants and `elements` only, so that XLA, which compiles
    each input shape with its size known, folds it to a constant.

    Args:
        dtype: the input's dtype.
        elements: the input's number of elements, an integer tensor.

    Returns:
        A scalar boolean tensor, `products_win(dtype, elements)`.

    Example:
    >>> import os, tempfile
    >>> os.environ["KERAS_AMP_PLUS_CACHE_DIR"] = tempfile.mkdtemp()
    >>> bool(products_win_at_run_time("float32", tf.constant(2**20)))
    True
    >>> del os.environ["KERAS_AMP_PLUS_CACHE_DIR"]
    """
    name = tf.as_dtype(dtype).name
    cells = [cell for cell in cached_cells() if cell["dtype"] == name]
    if not cells:
        return tf.constant(True)
    sizes = tf.constant([float(cell["elements"]) for cell in cells], tf.float64)
    wins = tf.constant([cell["ratio"] < 1.0 for cell in cells])
    octaves = tf.abs(tf.math.log(sizes / tf.cast(elements, tf.float64)) / math.log(2.0))
    nearest = tf.argmin(octaves)  # the first of equals, as `min` takes
    too_far = tf.gather(octaves, nearest) > NEAREST_OCTAVES
    return tf.logical_or(too_far, tf.gather(wins, nearest))


def measure_sums(
    dtype_names=DTYPES, seconds: float = 20.0, reps: int = 7, passes: int = 2
) -> dict:
    """Race the products and Keras's formula inside XLA and cache the ratios.

    Runs eagerly (never inside a `tf.function`). Cells are measured per
    size, smallest first, each in every precision, then again, `passes`
    times in all, until `seconds` of wall time are spent
    (`_ratio_race.race_ratio_cells`); a cell's ratio is the geometric
    mean over its passes. The cells done are cached.

    Args:
        dtype_names: the input dtypes to race (names). Defaults to float32,
            bfloat16 and float16.
        seconds: wall-time budget. Defaults to `20.0`.
        reps: interleaved calls per form and cell in each pass. Defaults to
            `7`.
        passes: how many times each cell is raced at most. Defaults to `2`.

    Returns:
        `{"path": cache file, "cells": [{"dtype", "shape", "elements",
        "ratio" (the products' CPU time / the formula's), "passes"}]}`.
    """
    specs = [(name, shape) for shape in RACED_SHAPES for name in dtype_names]
    return _ratio_race.race_ratio_cells(
        "measure_sums",
        specs,
        lambda dtype_name, shape: _products_ratio(dtype_name, shape, reps),
        cache_path(),
        seconds,
        passes,
    )


def _products_ratio(dtype_name, shape, reps) -> float:
    """Return the products' median CPU time over the formula's, one pass.

    Keras's own `GroupNormalization(groups=-1)` runs in the same rounds, as
    a model's other layers run between this one's calls: timed alone, the
    products' ratio at the smallest half-precision sizes came out lower than
    in the benchmarks' rounds beside Keras's layer (`benchmarks/layers.py`),
    which chose them where they ran slower than Keras's layer.
    """
    steps = {
        products: _xla_step(shape, dtype_name, products) for products in (False, True)
    }
    steps["keras"] = _keras_step(shape, dtype_name)
    medians = _path_calibration.time_interleaved(steps, reps)
    return medians[True] / medians[False]


def _keras_step(shape, dtype_name):
    """Return a `jit_compile=True` step of Keras's instance norm, the neighbour."""
    import keras

    policy = "float32" if dtype_name == "float32" else f"mixed_{dtype_name}"
    layer = keras.layers.GroupNormalization(groups=-1, dtype=policy)
    layer.build(shape)
    x, upstream = _path_calibration.raced_inputs(shape, dtype_name)

    @tf.function(jit_compile=True)
    def step(x, upstream):
        with tf.GradientTape() as tape:
            tape.watch(x)
            outputs = layer(x)
        weights = [x, *layer.trainable_weights]
        return outputs, tape.gradient(outputs, weights, output_gradients=upstream)

    return lambda: step(x, upstream)


def _xla_step(shape, dtype_name, products):
    """Return a `jit_compile=True` forward + backward step of one form."""
    from keras_amp_plus.layers import _keras_formula

    normalize = (
        _keras_formula.normalize_by_products
        if products
        else _keras_formula.normalize_by_reductions
    )
    x, upstream = _path_calibration.raced_inputs(shape, dtype_name)
    weight_shape = [1] * (len(shape) - 1) + [shape[-1]]
    gamma = tf.random.stateless_uniform(weight_shape, (5, 6), 0.5, 1.5)
    beta = tf.random.stateless_normal(weight_shape, (7, 8))

    @tf.function(jit_compile=True)
    def step(x, upstream, gamma, beta):
        with tf.GradientTape() as tape:
            tape.watch([x, gamma, beta])
            outputs = normalize(x, gamma, beta, 1e-3, _STAT_AXES, x.dtype)
        # The outputs too, as the next layer reads them.
        grads = tape.gradient(outputs, [x, gamma, beta], output_gradients=upstream)
        return outputs, grads

    return lambda: step(x, upstream, gamma, beta)

"""Measured path choice for graph steps: once per CPU model and TensorFlow.

In a graph step (no XLA around the model) the fused kernels and Keras's
formula race per shape, and which one wins below the matrix-product size
depends on the CPU (its vector width, whether TensorFlow turns oneDNN on) and
on TensorFlow's kernels. `measure_paths` times them (for middle axes also
TensorFlow's fused batch-norm kernel, on the whole batch (`_batch_norm_formula`)
and, for large samples, per sample (`_per_sample_batch_norm`)) on a few sizes per kind
of statistics (trailing axes: layer norm; middle axes: instance norm) and
input precision, forward + backward, interleaved, medians of process CPU
time, and writes the winners to a JSON file in
`keras_amp_plus._hardware.cache_dir()` named after the CPU model, its
features, the TensorFlow version, the oneDNN switch and the revision of the
raced implementations.
`measured_path` reads them back for `_path_choice`.

Measuring takes seconds and compiles kernels, so it never runs inside a
model's traced step: `python -m keras_amp_plus doctor` runs it (or call
`measure_paths` eagerly). Without a cached measurement `_path_choice` falls
back to its rule from the input's size and dtype and the oneDNN setting.
"""

import functools
import hashlib
import json
import math
import os
import random
import statistics
import time

import tensorflow as tf

from keras_amp_plus import _compat, _hardware
from keras_amp_plus.layers import _validation

FUSED_KERNELS = "fused_kernels"
KERAS_FORMULA = "keras_formula"
BATCH_NORM = "batch_norm"
PER_SAMPLE_BATCH_NORM = "per_sample_batch_norm"

# Shapes timed, smallest first. Trailing axes: below the matrix-product size,
# where the answer differs between CPUs (above it the kernels won everywhere
# measured). Middle axes: one per octave from 2**18 to 2**21 elements, where
# the winner changes from shape to shape (a measurement two octaves away
# chose Keras's formula for 8x32x32x64 in float32, where the kernels ran
# 0.75x it on an AMD EPYC Zen 4), and one above the matrix-product size,
# where TensorFlow's batch-norm kernel beat the kernels for bfloat16 and
# float32 on an Intel Xeon. At 2**20 elements two shapes: samples large
# enough for the per-sample batch norm and samples below it, whose winner
# among the other paths differs (`_nearest_cell`): on an Intel Xeon Ice Lake
# the batch-norm kernel ran 0.70-0.74x Keras's layer at 8x64x64x32 (float32,
# second to the per-sample one) but 0.77-0.88x at 16x32x32x64, where the
# kernels ran 0.67-0.73x (`benchmarks/paths.py`).
TRAILING_SHAPES = ((512, 256), (2048, 256), (2048, 1024))
MIDDLE_SHAPES = (
    (8, 16, 16, 32),
    (16, 16, 16, 64),
    (8, 32, 32, 64),
    (8, 64, 64, 32),
    (16, 32, 32, 64),
    (8, 64, 64, 64),
    (32, 32, 32, 128),
)
DTYPES = ("bfloat16", "float32")
# Another path must be this much faster than the safe one (`safe_path`) to be
# chosen: on a loaded machine a median of a few calls moves by 10-15%.
WIN_MARGIN = 0.85
# In steps traced for any batch size, instance norm below this many elements
# keeps Keras's formula as the safe side: there the kernels' two XLA launches
# cost more than they save (slower than the formula in every race at the
# grid's 65k-element shape, faster or even at its 262k one).
KERNELS_SAFE_MIN_ELEMENTS = 2**17
# From this many elements on, instance norm in such steps keeps TensorFlow's
# fused batch-norm kernel as the safe side where it applies: there the
# kernels' sums are matrix products after transposes of the whole input, and
# the batch-norm kernel ran faster than them for every input precision, with
# or without a known batch size, at the grid's two largest shapes (the
# kernels ran slower than Keras's layer at the largest in float32 and
# float16).
BATCH_NORM_SAFE_MIN_ELEMENTS = 2**22
# A measurement stands for inputs up to this many octaves of elements away.
NEAREST_OCTAVES = 2.0
# Part of the cache key: raise it whenever a raced implementation changes, so
# that winners measured on the earlier code are measured again, not reused.
PATHS_REVISION = 15


@functools.cache
def _machine_digest() -> str:
    """Hash of CPU model and features, TensorFlow, oneDNN, paths' revision."""
    key = json.dumps(
        [
            _hardware.cpu_facts(),
            tf.__version__,
            _compat.onednn_enabled(),
            PATHS_REVISION,
        ],
        sort_keys=True,
    )
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def cache_path() -> str:
    """Return the cache file of this CPU model, TensorFlow and oneDNN state."""
    return cache_file("normalization_paths")


def cache_file(stem: str) -> str:
    """Return the cache file `stem` of this CPU model, TensorFlow and oneDNN."""
    return os.path.join(_hardware.cache_dir(), f"{stem}_{_machine_digest()}.json")


_loaded = {}


def read_cells(path):
    """Return the cached measurements at `path` (read once per process)."""
    if path not in _loaded:
        try:
            with open(path, encoding="utf-8") as file:
                _loaded[path] = list(json.load(file)["cells"])
        except (OSError, ValueError, KeyError, TypeError):
            return []  # not measured yet: read again once it is
    return _loaded[path]


def cached_cells() -> list:
    """Return the measurements cached for this machine (empty when none)."""
    return list(read_cells(cache_path()))


def _dtype_family(dtype) -> str:
    """float16 inputs race like bfloat16 ones (half-width reads, float32 math).

    Races of float16's own picked winners that ran slower against Keras's
    layer than bfloat16's (benchmarks/README.md). Where the kernels won
    bfloat16's race narrowly, float16 reads it as `float16_path` says.
    """
    name = tf.as_dtype(dtype).name
    return "bfloat16" if name in ("bfloat16", "float16") else "float32"


def measured_path(
    elements, trailing_statistics, dtype, unknown_batch=False, unavailable=()
):
    """Return the measured faster path for such an input, or None.

    Args:
        elements: the input's number of elements.
        trailing_statistics: True for statistics over trailing axes.
        dtype: the input's dtype.
        unknown_batch: whether the step was traced for any batch size (then
            the winners measured in such steps apply). Defaults to `False`.
        unavailable: paths this input cannot take. Where the nearest
            measurement's winner is one of them, the winner among the paths
            it raced that remain (`winner`); of measurements equally near,
            the one raced with the per-sample path exactly where the input
            can take it (`_nearest_cell`). Defaults to `()`: every path.

    Returns:
        A path from the nearest measured size of the same kind and
        precision family (read by `float16_path` for float16), or None
        where nothing measured lies within `NEAREST_OCTAVES` (or the winner
        is unavailable and the cell has no times to choose another by).

    Example:
    >>> import os, tempfile
    >>> os.environ["KERAS_AMP_PLUS_CACHE_DIR"] = tempfile.mkdtemp()
    >>> print(measured_path(2**20, True, "bfloat16"))
    None
    >>> del os.environ["KERAS_AMP_PLUS_CACHE_DIR"]
    """
    nearest = _nearest_cell(
        elements, trailing_statistics, dtype, unknown_batch, unavailable
    )
    if nearest is None or _octaves_apart(nearest, elements) > NEAREST_OCTAVES:
        return None
    path, ratios = nearest["path"], nearest.get("ratios", {})
    if path in unavailable:
        path = _winner_among(ratios, unavailable, nearest)
        if path is None:
            return None
    if tf.as_dtype(dtype) == tf.float16:
        return float16_path(ratios, path)
    return path


def _winner_among(ratios, unavailable, cell):
    """Return the winner of `cell`'s race without the `unavailable` paths."""
    remaining = {name: r for name, r in ratios.items() if name not in unavailable}
    if KERAS_FORMULA not in remaining:
        return None  # a hand-written cell without times
    unknown_batch = cell.get("unknown_batch", False)
    batch_norm = BATCH_NORM in remaining
    safe = safe_path(unknown_batch, cell["trailing"], cell["elements"], batch_norm)
    return winner(remaining, safe if safe in remaining else KERAS_FORMULA)


def float16_path(ratios, path) -> str:
    """Return the path float16 takes from bfloat16's measurement.

    float16 inputs borrow bfloat16's races (`_dtype_family`), but XLA's
    float16 code is slower than its bfloat16 code by more than TensorFlow's
    batch-norm kernel's is (benchmarks/README.md). So where the kernels won
    bfloat16's race without beating the batch-norm kernel by `WIN_MARGIN`,
    float16 takes the batch-norm kernel.

    Args:
        ratios: the measured cell's CPU time of each path over the formula's.
        path: the cell's winner.

    Example:
    >>> ratios = {"keras_formula": 1.0, "fused_kernels": 0.48, "batch_norm": 0.51}
    >>> float16_path(ratios, "fused_kernels")
    'batch_norm'
    >>> float16_path({**ratios, "fused_kernels": 0.3}, "fused_kernels")
    'fused_kernels'
    """
    if path != FUSED_KERNELS or BATCH_NORM not in ratios:
        return path
    close = ratios[FUSED_KERNELS] >= WIN_MARGIN * ratios[BATCH_NORM]
    return BATCH_NORM if close else path


def unmeasured_path(
    elements, trailing_statistics, dtype, batch_norm_applies, unavailable=None
) -> str:
    """Return the path of a step traced for any batch size, measured nowhere near.

    That is the safe side (`safe_path`), unless the nearest measurement of
    the same kind and precision family, however far away, timed the safe
    side slower than Keras's formula: then the formula, as `winner` chooses
    for the measured sizes, so that batches beyond the measured sizes do not
    switch to a path that lost at the nearest of them.

    Args:
        elements: the input's number of elements.
        trailing_statistics: True for statistics over trailing axes.
        dtype: the input's dtype.
        batch_norm_applies: whether the input can take `BATCH_NORM`.
        unavailable: as in `measured_path`, for the choice between equally
            near measurements. Defaults to `None` (the first of them).

    Example:
    >>> import os, tempfile
    >>> os.environ["KERAS_AMP_PLUS_CACHE_DIR"] = tempfile.mkdtemp()
    >>> unmeasured_path(2**16, False, "float32", batch_norm_applies=True)
    'keras_formula'
    >>> del os.environ["KERAS_AMP_PLUS_CACHE_DIR"]
    """
    safe = safe_path(True, trailing_statistics, elements, batch_norm_applies)
    nearest = _nearest_cell(elements, trailing_statistics, dtype, True, unavailable)
    if nearest is None:
        return safe
    ratios = nearest.get("ratios", {})  # a hand-written cell may have none
    if safe not in ratios or KERAS_FORMULA not in ratios:
        return safe
    return _no_slower_than_formula(ratios, safe)


def _nearest_cell(
    elements, trailing_statistics, dtype, unknown_batch, unavailable=None
):
    """Return the measured cell of that kind nearest in size, or None.

    With `unavailable` given (the paths the input cannot take), of cells
    equally near the one whose race had the per-sample batch norm exactly
    where the input can take it: the other paths' times depend on the
    sample's size too, not only on the input's.
    """
    family = _dtype_family(dtype)
    candidates = [
        cell
        for cell in read_cells(cache_path())
        if cell["trailing"] == bool(trailing_statistics)
        and cell["dtype"] == family
        and cell.get("unknown_batch", False) == bool(unknown_batch)
    ]
    if not candidates or not elements:
        return None

    def distance(cell):
        return _octaves_apart(cell, elements), _other_kind(cell, unavailable)

    return min(candidates, key=distance)


def _other_kind(cell, unavailable) -> bool:
    """Return whether `cell`'s race and the input differ in the per-sample path.

    True where the cell raced the per-sample batch norm and the input cannot
    take it, or the other way round. `unavailable` None: False (no
    preference between equally near cells).
    """
    if unavailable is None:
        return False
    raced = PER_SAMPLE_BATCH_NORM in cell.get("ratios", {})
    return raced == (PER_SAMPLE_BATCH_NORM in unavailable)


def _octaves_apart(cell, elements):
    return abs(math.log2(cell["elements"]) - math.log2(elements))


def raced_inputs(shape, dtype):
    """Return `(x, upstream)`, the seeded input and upstream gradient every race times.

    Example:
    >>> x, upstream = raced_inputs((2, 3), "bfloat16")
    >>> x.dtype.name, tuple(upstream.shape)
    ('bfloat16', (2, 3))
    """
    x = tf.cast(tf.random.stateless_normal(shape, (1, 2), mean=0.5), dtype)
    upstream = tf.cast(tf.random.stateless_normal(shape, (3, 4)), dtype)
    return x, upstream


def _step(normalize, shape, dtype, unknown_batch):
    """Return a graph step (forward + backward) of `normalize` and its inputs.

    With `unknown_batch`, traced for any batch size, as `fit` traces a
    `tf.data` pipeline: TensorFlow's kernels (the formula's, the batch-norm
    one) then lose optimizations a known shape allows, XLA's do not.
    """
    trailing = len(shape) == 2
    stat_axes = (1,) if trailing else (1, 2)
    params = [1, shape[1]] if trailing else [1, 1, 1, shape[-1]]
    x, upstream = raced_inputs(shape, dtype)
    gamma, beta = tf.ones(params), tf.zeros(params)

    signature = None
    if unknown_batch:
        data = tf.TensorSpec((None, *shape[1:]), dtype)
        weights = tf.TensorSpec(params, tf.float32)
        signature = [data, data, weights, weights]

    @tf.function(jit_compile=False, input_signature=signature)
    def step(x, upstream, gamma, beta):
        with tf.GradientTape() as tape:
            tape.watch([x, gamma, beta])
            outputs = normalize(x, gamma, beta, 1e-3, stat_axes, dtype)
        # The outputs too, as the next layer reads them: without them grappler
        # prunes the formula's last ops (the gradient does not read them),
        # which a model never does; the kernels' cannot be pruned.
        grads = tape.gradient(outputs, [x, gamma, beta], output_gradients=upstream)
        return outputs, grads

    return lambda: step(x, upstream, gamma, beta)


def winner(ratios, safe) -> str:
    """Return the path a measurement chooses: the safe side unless beaten.

    The fastest path wins where it beats the safe side by `WIN_MARGIN`. A
    safe side measured slower than Keras's formula gives way to the formula
    first: the safe sides are what ran faster on the CPUs measured (a
    batch-norm kernel without oneDNN, for one, ran slower than the formula),
    and no choice may be slower than Keras's own layer.

    Args:
        ratios: each raced path's CPU time over Keras's formula's.
        safe: the path `safe_path` names for the cell.

    Example:
    >>> winner({"keras_formula": 1.0, "fused_kernels": 0.9}, "keras_formula")
    'keras_formula'
    >>> winner({"keras_formula": 1.0, "batch_norm": 1.2}, "batch_norm")
    'keras_formula'
    """
    safe = _no_slower_than_formula(ratios, safe)
    fastest = min(ratios, key=ratios.get)
    return fastest if ratios[fastest] < WIN_MARGIN * ratios[safe] else safe


def _no_slower_than_formula(ratios, safe):
    """Return `safe`, or Keras's formula where `ratios` timed it faster."""
    return KERAS_FORMULA if ratios[safe] > ratios[KERAS_FORMULA] else safe


def safe_path(
    unknown_batch: bool,
    trailing_statistics=True,
    elements=None,
    batch_norm_applies=False,
) -> str:
    """Return the path another must beat by `WIN_MARGIN` to be chosen.

    Keras's formula (Keras's own layer) in steps traced for their batch size.
    In steps traced for any batch size, where TensorFlow's kernels lose
    optimizations a known shape allows and XLA's do not, the fused kernels
    (where the layers ran before these steps were measured), except for
    instance norm below `KERNELS_SAFE_MIN_ELEMENTS` (Keras's formula) and
    from `BATCH_NORM_SAFE_MIN_ELEMENTS` on (TensorFlow's batch-norm kernel,
    where it applies).

    Args:
        unknown_batch: whether the step is traced for any batch size.
        trailing_statistics: True for statistics over trailing axes (layer
            norm). Defaults to `True`.
        elements: the input's number of elements, or None (large).
        batch_norm_applies: whether the input can take `BATCH_NORM`.
            Defaults to `False`.

    Example:
    >>> safe_path(unknown_batch=True)
    'fused_kernels'
    >>> safe_path(unknown_batch=True, trailing_statistics=False, elements=2**16)
    'keras_formula'
    >>> safe_path(True, False, elements=2**24, batch_norm_applies=True)
    'batch_norm'
    """
    if not unknown_batch:
        return KERAS_FORMULA
    if trailing_statistics:
        return FUSED_KERNELS
    if elements is not None and elements < KERNELS_SAFE_MIN_ELEMENTS:
        return KERAS_FORMULA
    large = elements is None or elements >= BATCH_NORM_SAFE_MIN_ELEMENTS
    return BATCH_NORM if large and batch_norm_applies else FUSED_KERNELS


def time_interleaved(steps, reps):
    """Return {name: median CPU seconds} of `steps` called interleaved."""
    for step in steps.values():  # trace, compile, warm
        step()
        step()
    times = {name: [] for name in steps}
    # In an order shuffled each round (seeded), as the benchmarks call them:
    # no path always runs right after the same other one.
    order, shuffle = list(steps), random.Random(0).shuffle
    for _ in range(reps):
        shuffle(order)
        for name in order:
            step = steps[name]
            start = time.process_time()
            step()
            times[name].append(time.process_time() - start)
    return {name: statistics.median(values) for name, values in times.items()}


def race_in_passes(specs, race, seconds: float, passes: int) -> dict:
    """Return `{index in specs: [race(spec) of each pass]}`, within `seconds`.

    Each pass runs `race` on every spec in order; the next pass starts over.
    Past `seconds` of wall time nothing more starts: the specs reached in
    fewer passes (or none) have fewer results (or none).

    Args:
        specs: what to race, in order (a sequence).
        race: `race(spec)`, one measurement of one spec.
        seconds: wall-time budget.
        passes: how many times each spec is raced at most.

    Returns:
        The results by index of their spec, in the order of `specs`; specs
        not reached are absent.

    Example:
    >>> race_in_passes(["a", "b"], str.upper, seconds=60.0, passes=2)
    {0: ['A', 'A'], 1: ['B', 'B']}
    """
    deadline = time.monotonic() + seconds
    measured = {}
    for _ in range(passes):
        for index, spec in enumerate(specs):
            if time.monotonic() >= deadline:
                return measured
            measured.setdefault(index, []).append(race(spec))
    return measured


def measure_paths(seconds: float = 30.0, reps: int = 11, passes: int = 2) -> dict:
    """Race the paths in graph steps and cache the winners on disk.

    Runs eagerly (never call it inside a `tf.function`). Cells are measured
    smallest first, each in steps traced for its batch size and for any
    batch size; then again, `passes` times in all, until `seconds` of wall
    time are spent. A cell's ratios are the geometric means over its passes:
    on a shared machine a slowdown can last a whole cell's rounds, which a
    second pass tens of seconds later rarely meets again. The cells done are
    cached.

    Args:
        seconds: wall-time budget. Defaults to `30.0`.
        reps: interleaved calls per path and cell in each pass. Defaults to
            `11`.
        passes: how many times each cell is raced at most. Defaults to `2`.

    Returns:
        `{"path": cache file, "cells": [{"trailing", "dtype", "shape",
        "elements", "unknown_batch", "ratios" (each path's CPU time / the
        formula's), "passes", "path" (the winner)}]}`.
    """
    _validation.check_eager("measure_paths")
    specs = _raced_cells()
    measured = race_in_passes(
        specs, lambda spec: _race_cell(*spec, reps), seconds, passes
    )
    cells = [_cell_of(specs[index], ratios) for index, ratios in measured.items()]
    path = cache_path()
    write_cells(path, cells)
    return {"path": path, "cells": cells}


def _raced_cells() -> list:
    """Return `(shape, dtype, unknown_batch, {path: normalize})` to race, in order."""
    from keras_amp_plus.layers import (
        _batch_norm_formula,
        _fused_normalization,
        _keras_formula,
        _per_sample_batch_norm,
    )

    paths = {
        KERAS_FORMULA: _keras_formula.keras_formula_normalize,
        FUSED_KERNELS: _fused_normalization.kernels_normalize,
    }
    middle_paths = {**paths, BATCH_NORM: _batch_norm_formula.batch_norm_normalize}
    specs = []
    for shapes, racing in ((TRAILING_SHAPES, paths), (MIDDLE_SHAPES, middle_paths)):
        for shape in shapes:
            for dtype in DTYPES:
                for unknown_batch in (False, True):
                    raced = dict(racing)
                    if _per_sample_applies(shape, dtype, unknown_batch):
                        per_sample = _per_sample_batch_norm.per_sample_normalize
                        raced[PER_SAMPLE_BATCH_NORM] = per_sample
                    specs.append((shape, dtype, unknown_batch, raced))
    return specs


def _race_cell(shape, dtype, unknown_batch, raced, reps) -> dict:
    """Return each raced path's median CPU time over the formula's, one pass."""
    steps = {name: _step(f, shape, dtype, unknown_batch) for name, f in raced.items()}
    medians = time_interleaved(steps, reps)
    return {name: t / medians[KERAS_FORMULA] for name, t in medians.items()}


def _cell_of(spec, pass_ratios) -> dict:
    """Return the cached cell of `spec` from the ratios of each of its passes."""
    shape, dtype, unknown_batch, raced = spec
    ratios = {
        name: statistics.geometric_mean(ratios[name] for ratios in pass_ratios)
        for name in raced
    }
    trailing, elements = len(shape) == 2, math.prod(shape)
    safe = safe_path(unknown_batch, trailing, elements, BATCH_NORM in raced)
    return {
        "trailing": trailing,
        "dtype": dtype,
        "shape": list(shape),
        "elements": elements,
        "unknown_batch": unknown_batch,
        "ratios": ratios,
        "passes": len(pass_ratios),
        "path": winner(ratios, safe),
    }


def _per_sample_applies(shape, dtype, unknown_batch):
    """Return True where the per-sample batch norm can take a raced cell."""
    from keras_amp_plus.layers import _per_sample_batch_norm

    if len(shape) == 2:
        return False
    x = tf.TensorSpec((None, *shape[1:]) if unknown_batch else shape, dtype)
    gamma = tf.TensorSpec([1, 1, 1, shape[-1]], tf.float32)
    return _per_sample_batch_norm.applies(x, gamma, 1e-3, (1, 2))


def write_cells(path, cells):
    """Write the cells atomically; a read-only disk only costs measuring again."""
    _loaded.pop(path, None)
    _hardware.write_json_cache(path, {"tensorflow": tf.__version__, "cells": cells})

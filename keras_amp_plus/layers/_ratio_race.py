"""Two forms of one computation raced per (dtype, shape) cell, ratios cached.

The races inside XLA (`_swish_calibration`, `_xla_sums_calibration`) each
time one form against another at a few sizes per input precision and keep
one ratio per cell: the geometric mean of its passes' ratios of median CPU
times (`_path_calibration.race_in_passes`: on a shared machine one pass's
medians moved by up to a quarter). What the forms are and how a ratio is
read back is theirs; measuring and caching the cells is this module's.
"""

import math
import statistics

from keras_amp_plus.layers import _path_calibration, _validation


def race_ratio_cells(function_name, specs, ratio_of, path, seconds, passes) -> dict:
    """Race every `(dtype name, shape)` of `specs` and cache the cells at `path`.

    Runs eagerly only. Cells are raced in the order of `specs`, then again,
    `passes` times in all, until `seconds` of wall time are spent; the
    cells reached are written to `path` (`_path_calibration.write_cells`).

    Args:
        function_name: the public function racing, named in the error
            raised inside a `tf.function`.
        specs: `(dtype name, shape)` pairs, in racing order.
        ratio_of: `ratio_of(dtype name, shape)`, one pass's ratio of the
            raced form's CPU time over the other's.
        path: the cache file.
        seconds: wall-time budget.
        passes: how many times each cell is raced at most.

    Returns:
        `{"path": path, "cells": [{"dtype", "shape", "elements", "ratio",
        "passes"}]}`.

    Example:
    >>> import os, tempfile
    >>> path = os.path.join(tempfile.mkdtemp(), "race.json")
    >>> race = race_ratio_cells(
    ...     "race", [("float32", (2, 3))], lambda dtype, shape: 0.5, path, 60.0, 2
    ... )
    >>> race["cells"]
    [{'dtype': 'float32', 'shape': [2, 3], 'elements': 6, 'ratio': 0.5, 'passes': 2}]
    """
    _validation.check_eager(function_name)
    measured = _path_calibration.race_in_passes(
        specs, lambda spec: ratio_of(*spec), seconds, passes
    )
    cells = [_cell(*specs[index], ratios) for index, ratios in measured.items()]
    _path_calibration.write_cells(path, cells)
    return {"path": path, "cells": cells}


def _cell(dtype_name, shape, ratios) -> dict:
    return {
        "dtype": dtype_name,
        "shape": list(shape),
        "elements": math.prod(shape),
        "ratio": statistics.geometric_mean(ratios),
        "passes": len(ratios),
    }

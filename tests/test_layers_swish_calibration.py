"""Swish's sigmoid race inside XLA: the threshold read from measured cells."""

import json

import pytest
import tensorflow as tf

from keras_amp_plus import _compat
from keras_amp_plus.layers import (
    _path_calibration,
    _precision,
    _swish_activation,
    _swish_calibration,
)

MIB = 2**20


def _write_cells(ratios, dtype="float32"):
    """Cache a measurement: recomputing's time over keeping's per raced size."""
    cells = [
        {"dtype": dtype, "shape": [size], "elements": size, "ratio": ratio}
        for size, ratio in ratios.items()
    ]
    _path_calibration.write_cells(_swish_calibration.cache_path(), cells)


@pytest.mark.parametrize(
    "ratios, expected",
    (
        # Recomputing wins from 2M on (the Ice Lake figures): 2M.
        ({MIB: 0.97, 2 * MIB: 0.83, 4 * MIB: 0.74, 8 * MIB: 0.73}, 2 * MIB),
        # Loses at 2M, wins from 4M (the Zen 4 figures): 4M.
        ({MIB: 1.10, 2 * MIB: 1.05, 4 * MIB: 0.89, 8 * MIB: 0.72}, 4 * MIB),
        # Wins everywhere raced: the table's where that is lower, else 1M.
        ({MIB: 0.80, 2 * MIB: 0.80, 4 * MIB: 0.80, 8 * MIB: 0.80}, MIB),
        # Keeps at the largest raced size: never recomputes.
        (
            {MIB: 0.80, 2 * MIB: 0.80, 4 * MIB: 0.80, 8 * MIB: 1.10},
            _swish_calibration.NEVER,
        ),
        # Ties (within CLEAR_WIN) take the table's choice: 4M.
        ({MIB: 1.02, 2 * MIB: 0.99, 4 * MIB: 1.01, 8 * MIB: 0.98}, 4 * MIB),
    ),
)
def test_threshold_from_measured_ratios(ratios, expected, empty_path_cache):
    _write_cells(ratios)
    assert _swish_calibration.recompute_threshold("float32", 4 * MIB) == expected


def test_threshold_below_the_raced_sizes_is_the_table_s(empty_path_cache):
    _write_cells({MIB: 0.8, 2 * MIB: 0.8})
    assert _swish_calibration.recompute_threshold("float32", 2**19) == 2**19


def test_without_a_measurement_the_table_applies(empty_path_cache):
    _write_cells({MIB: 0.5}, dtype="bfloat16")  # another precision's
    assert _swish_calibration.recompute_threshold("float32", 4 * MIB) == 4 * MIB


def test_layer_reads_the_measured_threshold(empty_path_cache, monkeypatch):
    # A measured threshold below the input's size makes XLA recompute the
    # sigmoid; the table's (above it) keeps it.
    shape = (64, 64)

    def exponentials():
        x = tf.random.stateless_normal(shape, (1, 2))

        @tf.function(jit_compile=True)
        def step(x):
            with tf.GradientTape() as tape:
                tape.watch(x)
                y = _swish_activation._swish_for_xla(x, tf.constant(1.0), False)
            return tape.gradient(y, x)

        hlo = step.experimental_get_compiler_ir(x)(stage="hlo")
        return hlo.count(" exponential(")

    kept = exponentials()
    _write_cells({4096: 0.5, 8192: 0.5})
    monkeypatch.setitem(
        _swish_activation.RECOMPUTE_SIGMOID_MIN_ELEMENTS, "float32", 8192
    )
    assert _swish_calibration.recompute_threshold("float32", 8192) == 4096
    assert exponentials() == kept + 1


def test_measure_recompute_caches_ratios(empty_path_cache, monkeypatch):
    measured = _swish_calibration.measure_recompute(["float32"], seconds=0.0)
    assert measured["cells"] == []  # no budget: nothing timed
    assert _swish_calibration.cached_cells() == []
    monkeypatch.setattr(_swish_calibration, "RACED_SHAPES", ((64, 64), (64, 128)))
    measured = _swish_calibration.measure_recompute(["float32"], reps=2)
    assert [cell["elements"] for cell in measured["cells"]] == [4096, 8192]
    assert all(cell["ratio"] > 0 for cell in measured["cells"])
    with open(measured["path"], encoding="utf-8") as file:
        assert json.load(file)["cells"] == measured["cells"]
    assert _swish_calibration.cached_cells() == measured["cells"]


def test_measure_recompute_takes_the_geometric_mean_of_two_passes(
    empty_path_cache, monkeypatch
):
    # A pass slowed down at one size (0.97: a tie) and one that was not
    # (0.81): recomputing wins there over both (0.89 < CLEAR_WIN).
    monkeypatch.setattr(_swish_calibration, "RACED_SHAPES", ((1024, 1024),))
    ratios = iter([0.97, 0.81])
    monkeypatch.setattr(_swish_calibration, "_recompute_ratio", lambda *_: next(ratios))
    (cell,) = _swish_calibration.measure_recompute(["float32"])["cells"]
    assert cell["passes"] == 2
    assert cell["ratio"] == pytest.approx((0.97 * 0.81) ** 0.5)
    assert _swish_calibration.recompute_threshold("float32", 4 * MIB) == MIB


def test_measure_recompute_refuses_to_run_traced():
    with pytest.raises(RuntimeError, match="must run eagerly"):
        tf.function(lambda: _swish_calibration.measure_recompute(["float32"]))()


def test_sigmoid_thresholds_reads_the_race_per_precision(empty_path_cache, monkeypatch):
    # float32's measured threshold replaces the table's; bfloat16 and float16
    # have one only where they recompute (oneDNN off, no float16 arithmetic).
    _write_cells({MIB: 0.8, 2 * MIB: 0.8, 4 * MIB: 0.8, 8 * MIB: 0.8})
    table = _swish_activation.RECOMPUTE_SIGMOID_MIN_ELEMENTS
    monkeypatch.setattr(_compat, "onednn_enabled", lambda: False)
    monkeypatch.setattr(_precision, "emulated_float16", lambda d: d == tf.float16)
    assert _swish_activation.sigmoid_thresholds() == {
        "float32": MIB,
        "bfloat16": table["bfloat16"],
        "float16": table["float16"],
    }
    monkeypatch.setattr(_compat, "onednn_enabled", lambda: True)
    monkeypatch.setattr(_precision, "emulated_float16", lambda d: False)
    assert _swish_activation.sigmoid_thresholds() == {"float32": MIB}

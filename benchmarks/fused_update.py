"""Benchmark the scaler's XLA-compiled inner update against Keras's own update.

`LossScaleOptimizer` runs the inner optimizer's update as one XLA computation
in a graph step when the updated variables hold at least `MIN_ELEMENTS`
elements together (`keras_amp_plus.optimizers._compiled_update`). This times
`optimizer.apply` alone, inside a `tf.function`, for 20 float32 variables of
each size, with the update compiled ("fused") and as Keras runs it ("plain",
one kernel per element-wise op), interleaved; each figure is the median of
`--reps` rounds of process CPU time (`time.process_time()`, all threads) per
call. The break-even size is where the threshold belongs.

Usage: python benchmarks/fused_update.py [--quick] [--reps N] [--output PATH]
"""

import argparse
import json
import os
import pathlib
import statistics
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from machine import print_header

from keras_amp_plus.optimizers import LossScaleOptimizer
from keras_amp_plus.optimizers._compiled_update import MIN_ELEMENTS

RESULTS = pathlib.Path(__file__).parent / "results"
VARIABLES = 20
SIZES = (256, 1024, 2048, 4096, 16384, 65536, 262144)
QUICK_SIZES = (1024, 16384)
CALLS_PER_ROUND = 20


def make_apply(size, fused):
    """Return a `tf.function` applying Adam through the guard scaler."""
    rng = np.random.default_rng(0)
    variables = [keras.Variable(np.zeros(size, "float32")) for _ in range(VARIABLES)]
    optimizer = LossScaleOptimizer.guard(keras.optimizers.Adam(1e-3))
    optimizer.build(variables)
    if not fused:
        # What the update costs as Keras runs it: the update called directly.
        optimizer._compiled_updates.run = lambda update, g, v: update(g, v)
    grads = [tf.constant(rng.normal(size=size).astype("float32")) for _ in variables]
    apply = tf.function(lambda: optimizer.apply(grads, variables))
    apply()
    return apply


def time_size(size, reps):
    """Return one row: median CPU ms per apply, fused and plain."""
    previous = _set_min_elements(0)  # fused at every size here
    try:
        applies = {"fused": make_apply(size, True), "plain": make_apply(size, False)}
    finally:
        _set_min_elements(previous)
    times = {name: [] for name in applies}
    for _ in range(reps):
        for name, apply in applies.items():
            start = time.process_time()
            for _ in range(CALLS_PER_ROUND):
                apply()
            times[name].append(1e3 * (time.process_time() - start) / CALLS_PER_ROUND)
    fused, plain = (statistics.median(times[n]) for n in ("fused", "plain"))
    return {
        "elements_per_variable": size,
        "elements_total": size * VARIABLES,
        "fused_ms": fused,
        "plain_ms": plain,
        "ratio": fused / plain,
        "fused_at_default_threshold": size * VARIABLES >= MIN_ELEMENTS,
    }


def _set_min_elements(value):
    from keras_amp_plus.optimizers import _compiled_update

    previous = _compiled_update.MIN_ELEMENTS
    _compiled_update.MIN_ELEMENTS = value
    return previous


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 sizes, 5 rounds")
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    reps = args.reps or (5 if args.quick else 15)
    machine = print_header("Scaler's XLA-compiled inner update vs Keras's, Adam")
    print(f"\n{VARIABLES} variables of N elements; CPU ms per optimizer.apply")
    print(f"{'N':>8} {'total':>9} {'fused ms':>9} {'plain ms':>9} {'ratio':>6}  used")
    rows = []
    for size in QUICK_SIZES if args.quick else SIZES:
        row = time_size(size, reps)
        rows.append(row)
        used = "fused" if row["fused_at_default_threshold"] else "plain"
        print(
            f"{size:>8} {row['elements_total']:>9} {row['fused_ms']:9.3f} "
            f"{row['plain_ms']:9.3f} {row['ratio']:6.2f}  {used}",
            flush=True,
        )
    print(f"(ratio = fused / plain; `used`: the path at MIN_ELEMENTS={MIN_ELEMENTS})")
    name = "fused_update_quick.json" if args.quick else "fused_update.json"
    output = pathlib.Path(args.output or RESULTS / name)
    output.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "benchmark": "fused_update",
        "machine": machine,
        "variables": VARIABLES,
        "reps": reps,
        "min_elements": MIN_ELEMENTS,
        "timer": "time.process_time (process CPU time, all threads) per apply",
        "rows": rows,
    }
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()

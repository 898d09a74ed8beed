"""Benchmark the loss scaler's finite flags: sums first vs `is_finite` per gradient.

On the gradients of `benchmarks/training.py`'s transformer (float32, every
trainable variable's shape, finite values), one call computes one flag per
gradient, in a `tf.function` ("graph") and in a `tf.function(jit_compile=True)`
("xla", as inside a model compiled with `jit_compile=True`):

- exact: `reduce_all(is_finite(g))` per gradient (Keras's scaler's check, and
  ours below `SUMS_MIN_ELEMENTS` gradient elements in all);
- sums: `keras_amp_plus.optimizers._finite_flags.finite_flags`, which reads
  each gradient's sum and takes the exact flags only on a step where a sum is
  not finite.

A third pair times a step whose sums overflow (finite values near float32's
largest): there `finite_flags` pays for both checks, which is its worst case.
A sweep of 12 gradients (6 kernels of width x width and their biases, width
64 to 1024: 25k to 6.3M elements) shows from which total size the sums pay
(`_finite_flags.SUMS_MIN_ELEMENTS`); the sums path is timed at every size.
Calls are interleaved, each figure the median process CPU time of `--reps`
rounds of `--calls` calls; the ratio is sums / exact.

Usage: python benchmarks/finite_flags.py [--quick] [--reps N] [--calls N]
    [--output PATH]
"""

import argparse
import json
import os
import pathlib
import statistics
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import tensorflow as tf
from machine import cpu_kind, print_header
from training import QUICK_SIZES, SIZES, transformer

from keras_amp_plus.optimizers import _finite_flags

RESULTS = pathlib.Path(__file__).parent / "results"
SWEEP_WIDTHS = (64, 128, 256, 512, 1024)


def gradient_shapes(size):
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy("mixed_bfloat16")
    try:
        model = transformer(True, size)
    finally:
        keras.config.set_dtype_policy(previous)
    return [tuple(v.shape) for v in model.trainable_variables]


def exact_flags(grads):
    return tf.stack([tf.reduce_all(tf.math.is_finite(g)) for g in grads])


def sum_flags(grads):
    positions = list(range(len(grads)))
    return _finite_flags.finite_flags(grads, positions, len(grads))


def time_calls(function, grads, calls):
    start = time.process_time()
    for _ in range(calls):
        flags = function(grads)
    np.asarray(flags)  # wait for the last call
    return (time.process_time() - start) / calls


def gradient_sets(quick):
    """Return {name: float32 gradients}: the transformer's, and a size sweep."""
    shapes = gradient_shapes(
        QUICK_SIZES["transformer"] if quick else SIZES["transformer"]
    )
    rng = np.random.default_rng(0)
    finite = [tf.constant(rng.normal(0, 1, s).astype("float32")) for s in shapes]
    sets = {
        "transformer": finite,
        "transformer_sums_overflow": [g * 0 + 3e38 for g in finite],
    }
    # A Dense-like kernel and bias per layer, 6 layers: 25k to 6.3M elements.
    for width in SWEEP_WIDTHS[:2] if quick else SWEEP_WIDTHS:
        layer = [(width, width), (width,)]
        sets[f"sweep_{width}"] = [
            tf.constant(rng.normal(0, 1, s).astype("float32")) for s in layer * 6
        ]
    return sets


def race(sets, reps, calls):
    """Return {(step, set, check): median CPU seconds per call}, interleaved."""
    cases = {}
    for step in ("graph", "xla"):
        for check, flags in (("exact", exact_flags), ("sums", sum_flags)):
            function = tf.function(flags, jit_compile=step == "xla")
            for name, grads in sets.items():
                assert np.asarray(function(grads)).all()  # every flag True
                cases[(step, name, check)] = (function, grads)
    times = {key: [] for key in cases}
    keys = list(cases)
    for rep in range(reps):
        shift = rep % len(keys)
        for key in keys[shift:] + keys[:shift]:
            function, grads = cases[key]
            times[key].append(time_calls(function, grads, calls))
    return {key: statistics.median(values) for key, values in times.items()}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small model, 5 reps")
    parser.add_argument("--reps", type=int, default=None, help="default 30")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--output", type=pathlib.Path, default=None)
    args = parser.parse_args()
    reps = args.reps or (5 if args.quick else 30)
    info = print_header("Loss scaler finite flags: sums first vs is_finite")
    # Race the sums path at every size, the small ones included, to see where
    # the size threshold belongs.
    _finite_flags.SUMS_MIN_ELEMENTS = 0
    sets = gradient_sets(args.quick)
    medians = race(sets, reps, args.calls)
    rows = []
    print(
        f"\n{'step':<6} {'gradients':<26} {'tensors':>7} {'elements':>9} "
        f"{'exact ms':>9} {'sums ms':>8} {'ratio':>6}"
    )
    for step in ("graph", "xla"):
        for name, grads in sets.items():
            exact = 1e3 * medians[(step, name, "exact")]
            sums = 1e3 * medians[(step, name, "sums")]
            elements = int(sum(np.prod(g.shape) for g in grads))
            row = {
                "step": step,
                "gradients": name,
                "tensors": len(grads),
                "elements": elements,
                "exact_ms": exact,
                "sums_ms": sums,
                "ratio": sums / exact,
            }
            rows.append(row)
            print(
                f"{step:<6} {name:<26} {len(grads):>7} {elements:>9} "
                f"{exact:9.2f} {sums:8.2f} {row['ratio']:6.2f}"
            )
    print(
        "process CPU ms per call, medians of interleaved rounds; ratio = sums / exact"
    )
    tag = cpu_kind(info) + ("_quick" if args.quick else "")
    output = args.output or RESULTS / f"finite_flags_{tag}.json"
    meta = {
        "cpu": info,
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "reps": reps,
        "calls": args.calls,
        "command": " ".join(["python", *sys.argv]),
    }
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()

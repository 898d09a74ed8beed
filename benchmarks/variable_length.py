"""Benchmark LayerNormalization and Swish on sequences of varying length.

A transformer fed text padded per batch (`keras.Input((None, features))`) has
its step traced with the sequence length unknown. XLA compiles a kernel per
shape, so our layers pad such inputs to a size bucket (`_row_buckets`: two
sizes per power of two) and pay a copy wherever the size is not a bucket.
This measures that cost where it shows: at lengths whose sizes are buckets
(128, 192) and lengths whose sizes are not (100, 200, 333).

For each layer, policy, (batch, features) pair and length, three graph
steps, forward + backward (upstream gradient given), are called interleaved,
in an order shuffled each round (`layers.time_interleaved`): Keras's layer
and ours in steps traced for any batch size and length (as `fit` traces a
`tf.data` pipeline of such batches), and ours traced for the one shape
("known"), our layer's cost where no padding is needed (its path for a known
shape: float32 Swish runs XLA's forward kernel there, oneDNN's for any length).
Each figure is the median process CPU time; the ratios are to Keras's in the
step for any length.

Usage: python benchmarks/variable_length.py [--quick] [--reps N]
    [--policies ...] [--layers LN Swish] [--output PATH]
"""

import argparse
import pathlib
import statistics
import time

import keras
import tensorflow as tf
from layers import (
    POLICIES,
    check_close,
    inputs_for,
    layer_pair,
    make_step,
    time_interleaved,
)
from machine import cpu_kind, print_header, write_results

RESULTS = pathlib.Path(__file__).parent / "results"
# (batch, features): a transformer of width 512 (feed-forward 2048) and one of
# width 1024 (feed-forward 4096) at batch 8 and 32; sizes 0.4M to 44M elements.
SHAPES = {
    "LN": [(8, 512), (32, 1024)],
    "Swish": [(8, 2048), (32, 4096)],
}
LENGTHS = (100, 128, 192, 200, 333)
QUICK_SHAPES = {"LN": [(8, 512)], "Swish": [(8, 2048)]}
QUICK_LENGTHS = (100, 128)


def time_case(kind, shape, policy, reps):
    """Return one row: median ms of each step and the ratios to Keras's."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        ours, theirs = layer_pair(kind)
        known = layer_pair(kind)[0]
        for layer in (ours, theirs, known):
            layer.build(shape)
        dtype = keras.config.dtype_policy().compute_dtype
    finally:
        keras.config.set_dtype_policy(previous)
    x, upstream = inputs_for(shape, dtype)
    steps = {
        "keras": make_step(theirs, "any_size", shape, dtype),
        "ours": make_step(ours, "any_size", shape, dtype),
        "ours_known": make_step(known, "graph", shape, dtype),
    }
    outputs = {name: step(x, upstream)[0] for name, step in steps.items()}
    error = max(
        check_close(outputs[name], outputs["keras"], dtype)
        for name in ("ours", "ours_known")
    )
    medians, reps = time_interleaved(steps, (x, upstream), reps)
    keras_ms = medians["keras"]
    return {
        "layer": kind,
        "shape": list(shape),
        "elements": shape[0] * shape[1] * shape[2],
        "policy": policy,
        "keras_ms": keras_ms,
        "ours_ms": medians["ours"],
        "ours_known_ms": medians["ours_known"],
        "ratio": medians["ours"] / keras_ms,
        "known_ratio": medians["ours_known"] / keras_ms,
        "max_output_difference": error,
        "reps": reps,
    }


def summarize(rows):
    """Return [{layer, policy, worst, median, worst_at, known_median}]."""
    groups = {}
    for row in rows:
        groups.setdefault((row["layer"], row["policy"]), []).append(row)
    return [
        {
            "layer": layer,
            "policy": policy,
            "worst": max(r["ratio"] for r in group),
            "median": statistics.median(r["ratio"] for r in group),
            "worst_at": max(group, key=lambda r: r["ratio"])["shape"],
            "known_median": statistics.median(r["known_ratio"] for r in group),
        }
        for (layer, policy), group in sorted(groups.items())
    ]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 shape, 2 lengths")
    parser.add_argument("--reps", type=int, default=5, help="minimum rounds")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--layers", nargs="+", default=list(SHAPES), choices=SHAPES)
    parser.add_argument("--output", type=pathlib.Path, default=None)
    return parser.parse_args()


def main():
    args = parse_args()
    machine = print_header("Varying sequence length: ours / Keras's, CPU time")
    suffix = "_quick" if args.quick else ""
    output = args.output or (
        RESULTS / f"variable_length_{cpu_kind(machine)}{suffix}.json"
    )
    shapes = QUICK_SHAPES if args.quick else SHAPES
    lengths = QUICK_LENGTHS if args.quick else LENGTHS
    start = time.time()
    print(
        f"\n{'layer':<6} {'shape':<18} {'policy':<15} {'keras ms':>9} "
        f"{'ours ms':>8} {'ratio':>6} {'known':>6}"
    )
    rows = []
    for kind in args.layers:
        for batch, features in shapes[kind]:
            for length in lengths:
                for policy in args.policies:
                    shape = (batch, length, features)
                    row = time_case(kind, shape, policy, args.reps)
                    rows.append(row)
                    print(
                        f"{kind:<6} {shape!s:<18} {policy:<15} "
                        f"{row['keras_ms']:9.2f} {row['ours_ms']:8.2f} "
                        f"{row['ratio']:6.2f} {row['known_ratio']:6.2f}",
                        flush=True,
                    )
    summary = summarize(rows)
    print(f"\n{'layer':<6} {'policy':<15} {'worst':>6} {'median':>7} {'known':>6}  at")
    for cell in summary:
        print(
            f"{cell['layer']:<6} {cell['policy']:<15} {cell['worst']:6.2f} "
            f"{cell['median']:7.2f} {cell['known_median']:6.2f}  "
            f"{tuple(cell['worst_at'])}"
        )
    print(
        "(ratio = ours / Keras's CPU time, both traced for any batch and length;"
        " known = ours traced for the one shape / Keras's: no padding)"
    )
    print(f"wall time {time.time() - start:.0f} s")
    write_results(
        output,
        machine,
        {"summary": summary, "rows": rows},
        tensorflow=tf.__version__,
        keras=keras.__version__,
        reps=args.reps,
        quick=args.quick,
    )


if __name__ == "__main__":
    main()

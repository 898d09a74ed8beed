"""Benchmark the layers called eagerly: at new shapes, and at one shape.

Eager calls are how a notebook runs `model(image)` per image, or a decoding
loop runs `model(tokens)` per token. XLA compiles a kernel per input shape,
so our layers run plain ops when called eagerly, compiling nothing. Two
loops, each of `--calls` eager calls, forward + backward (a `GradientTape`,
as an eager custom training loop takes it):

- "new shapes": every call at a shape not called before (a sequence one
  step longer, an image one row taller);
- "one shape": every call at the same shape, new to the process (any
  compilation included).

Ours and Keras's layer run interleaved, in an order shuffled each round; each
round uses shapes of its own, so no round reuses another's compilations.
Figures are median process CPU seconds per loop; ratio = ours / Keras's.

Usage: python benchmarks/eager_calls.py [--quick] [--reps N] [--calls N]
    [--policies ...] [--layers LN IN Swish] [--output PATH]
"""

import argparse
import pathlib
import random
import statistics
import time

import keras
import numpy as np
import tensorflow as tf
from layers import POLICIES, layer_pair
from machine import cpu_kind, print_header, write_results

RESULTS = pathlib.Path(__file__).parent / "results"
# The shape of call `step` of round `round_`: a (batch, length, features)
# sequence for the row layers, a (batch, height, width, channels) image for
# instance norm; lengths and heights never repeat across rounds and loops.
BASE_SIZES = {"LN": (2, 256), "Swish": (2, 256), "IN": (1, 16)}


def shape_of(kind, size):
    """Return the input shape of `kind` whose varying dimension is `size`."""
    if kind == "IN":
        batch, channels = BASE_SIZES[kind]
        return (batch, size, size + 3, channels)
    batch, features = BASE_SIZES[kind]
    return (batch, size, features)


def sizes_for(loop, round_, calls):
    """Return the varying dimension of each call of `loop` in `round_`."""
    first = 8 + round_ * (calls + 1) * 2 + (0 if loop == "new shapes" else 1)
    if loop == "new shapes":
        return [first + 2 * step for step in range(calls)]
    return [first] * calls


def run_loop(layer, kind, sizes, dtype, rng):
    """Call `layer` eagerly on each size with a tape; return CPU seconds."""
    inputs = [
        tf.constant(rng.standard_normal(shape_of(kind, s)), dtype=dtype) for s in sizes
    ]
    start = time.process_time()
    for x in inputs:
        with tf.GradientTape() as tape:
            tape.watch(x)
            outputs = layer(x)
        tape.gradient(outputs, [x, *layer.trainable_weights])
    return time.process_time() - start


def time_case(kind, policy, reps, calls):
    """Return the rows of one layer and policy: one per loop."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        pair = dict(zip(("ours", "keras"), layer_pair(kind), strict=True))
        dtype = keras.config.dtype_policy().compute_dtype
    finally:
        keras.config.set_dtype_policy(previous)
    for layer in pair.values():
        layer.build(shape_of(kind, 8))
    rng = np.random.default_rng(0)
    loops = ("new shapes", "one shape")
    seconds = {(loop, name): [] for loop in loops for name in pair}
    for round_ in range(reps):
        order = [(loop, name) for loop, name in seconds]
        random.Random(round_).shuffle(order)
        for loop, name in order:
            sizes = sizes_for(loop, round_, calls)
            seconds[loop, name].append(run_loop(pair[name], kind, sizes, dtype, rng))
    rows = []
    for loop in loops:
        ours = statistics.median(seconds[loop, "ours"])
        theirs = statistics.median(seconds[loop, "keras"])
        spread = max(seconds[loop, "ours"]) - min(seconds[loop, "ours"])
        rows.append(
            {
                "layer": kind,
                "policy": policy,
                "loop": loop,
                "calls": calls,
                "ours_s": ours,
                "keras_s": theirs,
                "ours_spread_s": spread,
                "ratio": ours / theirs,
                "reps": reps,
            }
        )
    return rows


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 rounds, 16 calls")
    parser.add_argument("--reps", type=int, default=5, help="rounds")
    parser.add_argument("--calls", type=int, default=32, help="calls per loop")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--layers", nargs="+", default=["LN", "IN", "Swish"])
    parser.add_argument("--output", type=pathlib.Path, default=None)
    args = parser.parse_args()
    if args.quick:
        args.reps, args.calls = 3, 16
    return args


def main():
    args = parse_args()
    machine = print_header("Eager calls: ours / Keras's, process CPU seconds")
    suffix = "_quick" if args.quick else ""
    output = args.output or RESULTS / f"eager_calls_{cpu_kind(machine)}{suffix}.json"
    print(
        f"{'layer':<6} {'policy':<15} {'loop':<11} {'keras s':>8} "
        f"{'ours s':>8} {'ratio':>6}"
    )
    rows = []
    for kind in args.layers:
        for policy in args.policies:
            for row in time_case(kind, policy, args.reps, args.calls):
                rows.append(row)
                print(
                    f"{kind:<6} {policy:<15} {row['loop']:<11} "
                    f"{row['keras_s']:>8.3f} {row['ours_s']:>8.3f} "
                    f"{row['ratio']:>6.2f}"
                )
    write_results(output, machine, {"rows": rows}, reps=args.reps, calls=args.calls)


if __name__ == "__main__":
    main()

"""Time the run-time batch-size switch of the normalization layers.

In a graph step traced for any batch size (`fit` on a `tf.data` pipeline
without `drop_remainder`), a layer whose measured winner changes with the
batch size switches between paths at run time (`tf.switch_case` in
`keras_amp_plus.layers._size_switch`). This script measures what the
switch itself costs: for each path, the layer running that path alone and the
layer running it behind a switch to a second path no batch reaches, beside
Keras's layer, in such a step, called interleaved as `layers.py` calls them,
median process CPU time. The difference is the switch's cost a step. In the
same rounds the layer as it chooses (its own paths by batch size, from this
machine's cached measurements or the rules: run the doctor first) is timed in
that step and in one traced for any image size, each against Keras's layer in
the same kind of step.

The header names the CPU; the JSON written to `benchmarks/results/` (named per
CPU kind) carries it with every cell.

Usage: python benchmarks/batch_switch.py [--policies ...] [--reps N]
    [--quick] [--output PATH]
"""

import argparse
import os
import pathlib
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
from layers import (
    POLICIES,
    RESULTS,
    build_pair,
    check_close,
    inputs_for,
    layer_pair,
    make_step,
    time_interleaved,
)
from machine import cpu_kind, print_header, write_results

from keras_amp_plus.layers import _path_choice

SHAPES = ((8, 16, 16, 32), (16, 16, 16, 64), (8, 32, 32, 64))
QUICK_SHAPES = ((8, 16, 16, 32),)
PATHS = (
    _path_choice.KERAS_FORMULA,
    _path_choice.FUSED_KERNELS,
    _path_choice.BATCH_NORM,
)
NEVER_REACHED = 2**40  # the first batch size of the switch's other branch
# The layer as it chooses its paths, by the step kind it is traced in.
CHOSEN = {"chosen": "tfdata", "chosen any_size": "any_size"}


def runs_for(path, switched):
    """Return the batch-size runs the layer is traced with: `path` for every batch."""
    if not switched:
        return ((1, path),)
    other = next(p for p in PATHS if p != path)
    return ((1, path), (NEVER_REACHED, other))


def traced_with_runs(step, runs, x, upstream):
    """Call `step` once while the layer's path choice returns `runs`."""
    choose = _path_choice.paths_by_batch_size
    _path_choice.paths_by_batch_size = lambda *args, **kwargs: runs
    try:
        return step(x, upstream)
    finally:
        _path_choice.paths_by_batch_size = choose


def time_cell(shape, policy, reps):
    """Return each path's ratio to Keras's alone and behind the switch."""
    previous = keras.config.dtype_policy()
    keras.config.set_dtype_policy(policy)
    try:
        ours, theirs, _ = build_pair("IN", shape, policy)
        dtype = keras.config.dtype_policy().compute_dtype
        variants = {}
        for key in [*((p, s) for p in PATHS for s in (False, True)), *CHOSEN]:
            layer = layer_pair("IN")[0]
            layer.build(shape)
            layer.set_weights(ours.get_weights())
            variants[key] = layer
    finally:
        keras.config.set_dtype_policy(previous)
    x, upstream = inputs_for(shape, dtype)
    steps = {
        "keras": make_step(theirs, "tfdata", shape, dtype),
        "keras any_size": make_step(theirs, "any_size", shape, dtype),
    }
    reference = steps["keras"](x, upstream)[0]
    check_close(steps["keras any_size"](x, upstream)[0], reference, dtype)
    for key, layer in variants.items():
        if key in CHOSEN:
            steps[key] = make_step(layer, CHOSEN[key], shape, dtype)
            check_close(steps[key](x, upstream)[0], reference, dtype)
            continue
        path, switched = key
        name = f"{path}{' switched' if switched else ''}"
        steps[name] = make_step(layer, "tfdata", shape, dtype)
        outputs = traced_with_runs(steps[name], runs_for(path, switched), x, upstream)
        check_close(outputs[0], reference, dtype)
    # Every round, not MAX_REPS: the switch costs tens of microseconds, a few
    # percent of these steps, below the spread of 25 rounds.
    medians, reps = time_interleaved(steps, (x, upstream), reps, max_reps=reps)
    keras_ms = medians["keras"]
    cells = {}
    for path in PATHS:
        alone, switched = medians[path], medians[f"{path} switched"]
        cells[path] = {
            "alone_ratio": alone / keras_ms,
            "switched_ratio": switched / keras_ms,
            "switch_ms": switched - alone,
        }
    chosen = {
        step_kind: medians[key]
        / medians["keras" if step_kind == "tfdata" else "keras any_size"]
        for key, step_kind in CHOSEN.items()
    }
    return {
        "shape": list(shape),
        "policy": policy,
        "keras_ms": keras_ms,
        "paths": cells,
        "chosen_ratio": chosen,
        "reps": reps,
    }


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the smallest shape")
    parser.add_argument("--reps", type=int, default=600, help="rounds, default 600")
    parser.add_argument("--policies", nargs="+", default=list(POLICIES))
    parser.add_argument("--output", type=pathlib.Path, default=None)
    return parser.parse_args()


def print_row(row):
    cells = "  ".join(
        f"{path} {c['alone_ratio']:.2f} -> {c['switched_ratio']:.2f}"
        f" ({1e3 * c['switch_ms']:+.0f} us)"
        for path, c in row["paths"].items()
    )
    chosen = " / ".join(f"{ratio:.2f}" for ratio in row["chosen_ratio"].values())
    print(
        f"{row['shape']!s:<18} {row['policy']:<15} {row['keras_ms']:8.2f}  {cells}"
        f"  chosen {chosen}",
        flush=True,
    )


def main():
    args = parse_args()
    info = print_header("The batch-size switch: each path alone and behind it")
    kind_tag = cpu_kind(info)
    suffix = "_quick" if args.quick else ""
    output = args.output or RESULTS / f"batch_switch_{kind_tag}{suffix}.json"
    start = time.time()
    print(f"\n{'shape':<18} {'policy':<15} {'keras ms':>8}  path alone -> switched")
    rows = []
    for shape in QUICK_SHAPES if args.quick else SHAPES:
        for policy in args.policies:
            rows.append(time_cell(shape, policy, args.reps))
            print_row(rows[-1])
    print(
        "(ratio = the layer's / Keras's CPU time in a step traced for any batch"
        " size, forward + backward, median; us = the switch's cost a step;"
        " chosen = the layer's own choice in that step / in one for any image size)"
    )
    print(f"wall time {time.time() - start:.0f} s")
    write_results(output, info, {"rows": rows}, reps=args.reps, quick=args.quick)


if __name__ == "__main__":
    main()

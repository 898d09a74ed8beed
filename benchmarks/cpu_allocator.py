"""Time large layer steps with TensorFlow's default CPU allocator and its BFC one.

With oneDNN off (TensorFlow's default on CPUs without AVX512) TensorFlow
allocates CPU tensors with `malloc`, and glibc maps blocks from 16-32 MiB on
afresh on every step, page-faulting them in each time. `TF_CPU_ALLOCATOR_USE_BFC=1`
makes TensorFlow pool them (oneDNN's allocator pools them when oneDNN is on).
The setting is read once per process, so each round runs one child process
per setting, alternating which goes first; each child times forward +
backward steps of our LayerNormalization and Keras's (float32, fed as
(rows / 128, 128, 256)), in a graph step and inside `jit_compile=True`,
interleaved as `layers.py` calls them, and reports median CPU ms. The
figures are the medians over rounds.

The header names the CPU; the JSON written to `benchmarks/results/` (named per
CPU kind) carries it.

Usage: python benchmarks/cpu_allocator.py [--rounds N] [--quick] [--output PATH]
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

ROWS = (8192, 16384, 24576)
QUICK_ROWS = (16384,)
STEPS = ("graph", "xla")
SETTINGS = {"malloc": None, "bfc": "1"}
VARIABLE = "TF_CPU_ALLOCATOR_USE_BFC"


def child(rows, reps):
    """Time the steps in this process; print {cell: median ms} as JSON."""
    import keras
    from layers import build_pair, inputs_for, make_step, time_interleaved

    medians = {}
    for count in rows:
        shape = (count // 128, 128, 256)
        ours, theirs, _ = build_pair("LN", shape, "float32")
        x, upstream = inputs_for(shape, "float32")
        for step_kind in STEPS:
            steps = {
                who: make_step(layer, step_kind, shape, "float32")
                for who, layer in (("ours", ours), ("keras", theirs))
            }
            for step in steps.values():
                step(x, upstream)
            cell, _ = time_interleaved(steps, (x, upstream), reps)
            for who, ms in cell.items():
                medians[f"{who} {step_kind} {count}"] = ms
    keras.backend.clear_session()
    print(json.dumps(medians))


def run_child(setting, rows, reps):
    """Return the child's medians with the allocator `setting`."""
    env = dict(os.environ)
    env.pop(VARIABLE, None)
    if SETTINGS[setting] is not None:
        env[VARIABLE] = SETTINGS[setting]
    script = pathlib.Path(__file__).resolve()
    command = [sys.executable, str(script), "--child", "--reps", str(reps)]
    command += ["--rows", *map(str, rows)]
    result = subprocess.run(
        command, env=env, capture_output=True, text=True, check=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--quick", action="store_true", help="one shape, 2 rounds")
    parser.add_argument("--rows", type=int, nargs="+", default=None)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", type=pathlib.Path, default=None)
    return parser.parse_args()


def main():
    args = parse_args()
    rows = args.rows or (QUICK_ROWS if args.quick else ROWS)
    if args.child:
        child(rows, args.reps)
        return
    from layers import RESULTS
    from machine import cpu_kind, print_header, write_results

    info = print_header("TensorFlow's CPU allocator: malloc vs BFC, large steps")
    kind_tag = cpu_kind(info)
    suffix = "_quick" if args.quick else ""
    output = args.output or RESULTS / f"cpu_allocator_{kind_tag}{suffix}.json"
    rounds = 2 if args.quick else args.rounds
    start = time.time()
    samples = {setting: [] for setting in SETTINGS}
    for index in range(rounds):
        order = list(SETTINGS) if index % 2 == 0 else list(SETTINGS)[::-1]
        for setting in order:
            samples[setting].append(run_child(setting, rows, args.reps))
    table = {
        setting: {
            cell: statistics.median(run[cell] for run in runs) for cell in runs[0]
        }
        for setting, runs in samples.items()
    }
    print(f"\n{'cell':<22} {'malloc ms':>10} {'BFC ms':>8} {'BFC / malloc':>13}")
    for cell, malloc_ms in table["malloc"].items():
        bfc_ms = table["bfc"][cell]
        print(f"{cell:<22} {malloc_ms:10.2f} {bfc_ms:8.2f} {bfc_ms / malloc_ms:13.2f}")
    print(
        f"({rounds} rounds; medians of process CPU time;"
        f" wall {time.time() - start:.0f} s)"
    )
    document = {"medians_ms": table, "samples": samples}
    write_results(
        output,
        info,
        document,
        rounds=rounds,
        reps=args.reps,
        TF_ENABLE_ONEDNN_OPTS=os.environ.get("TF_ENABLE_ONEDNN_OPTS"),
    )


if __name__ == "__main__":
    main()

"""Instance norm inside XLA: the plain layout vs Keras's `(..., channels, 1)` groups.

Inside a step XLA compiles whole, InstanceNormalization runs Keras's formula
(the fused kernels cannot join XLA's cluster), on one of two layouts: the
input as it is (statistics over its middle axes) or Keras's
`GroupNormalization` layout, the input viewed as `(..., channels, 1)` groups.
Which layout XLA compiles to the faster program depends on the dtype and the
CPU: a half-precision dtype the CPU has no arithmetic for (float16 without
AVX512-FP16; bfloat16 without AVX512-BF16 or AMX) is converted around each
operation, and XLA fuses the two layouts differently. This script times one
forward + backward step (`jit_compile=True`, gradients w.r.t. the input and
both weights) of Keras's `GroupNormalization(groups=-1)` program and of the
layer's formula on each layout, interleaved in an order shuffled each round,
median process CPU time, at the layer grid's instance-norm shapes, and prints
each layout's time as a ratio to Keras's program. `_keras_formula` takes the
group layout where this measured it faster.

Usage: python benchmarks/in_xla_layout.py [--quick] [--reps N]
    [--dtypes float32 bfloat16 float16] [--output PATH]
"""

import argparse
import os
import pathlib

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from layers import GRID, QUICK_GRID, RESULTS
from machine import cpu_kind, print_header, write_results
from moments_gradient import keras_group_formula, time_cell

from keras_amp_plus.layers import _keras_formula

DTYPES = ("float32", "bfloat16", "float16")
STAT_AXES = (1, 2)


def plain_layout(x, gamma, beta, epsilon):
    """The layer's formula on the input as it lies."""
    outputs, _ = _keras_formula.formula_forward(
        x, gamma, beta, epsilon, STAT_AXES, x.dtype
    )
    return outputs


def group_layout(x, gamma, beta, epsilon):
    """The layer's formula on Keras's `(..., channels, 1)` groups."""
    return _keras_formula._in_group_layout(x, gamma, beta, epsilon, STAT_AXES, x.dtype)


FORMULAS = {"keras": keras_group_formula, "plain": plain_layout, "group": group_layout}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 shapes, 5 reps")
    parser.add_argument("--reps", type=int, default=None, help="default 15")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--output", type=pathlib.Path, default=None)
    args = parser.parse_args()
    info = print_header("Instance norm inside XLA: plain vs group layout")
    suffix = "_quick" if args.quick else ""
    output = args.output or RESULTS / f"in_xla_layout_{cpu_kind(info)}{suffix}.json"
    reps = args.reps or (5 if args.quick else 15)
    shapes = (QUICK_GRID if args.quick else GRID)["IN"]
    print(f"\n{'shape':<20} {'dtype':<9} {'keras ms':>9} {'plain':>6} {'group':>6}")
    rows = []
    for shape in shapes:
        for dtype in args.dtypes:
            ms = time_cell(shape, dtype, reps, FORMULAS)
            ratios = {name: ms[name] / ms["keras"] for name in ("plain", "group")}
            rows.append(
                {"shape": list(shape), "dtype": dtype, "ms": ms, "ratios": ratios}
            )
            print(
                f"{shape!s:<20} {dtype:<9} {ms['keras']:9.2f} "
                f"{ratios['plain']:6.2f} {ratios['group']:6.2f}",
                flush=True,
            )
    print("(plain, group = the layer's formula on that layout / Keras's program)")
    write_results(output, info, {"rows": rows}, reps=reps, quick=args.quick)


if __name__ == "__main__":
    main()

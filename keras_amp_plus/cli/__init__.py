"""Command line: `python -m keras_amp_plus {doctor,demo}`.

- `doctor [--json] [--probe-seconds S]`: versions, oneDNN, CPU low-precision
  features, devices, XLA, a matmul probe and a dtype policy recommendation.
- `demo [--log-dir DIR] [--epochs N] [--quick]`: one small model trained as
  float32, as mixed_bfloat16 and as an overflowing mixed_float16 run that
  AMPMonitor rescues; a comparison table and TensorBoard logs.

The benchmarks live in the repository's `benchmarks/` (`make bench`).
Each command imports Keras and TensorFlow only when it runs, so `doctor` can
report a wrong backend or a broken install.
"""

import argparse
import math
import os
import sys


def _number(text: str, kind):
    """Parse `text` as a finite, strictly positive `kind` (int or float)."""
    expected = "a positive integer" if kind is int else "a positive number"
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be {expected}, received {text!r}")
    return value


def _positive_float(text: str) -> float:
    """Parse a finite, strictly positive float for argparse."""
    return _number(text, float)


def _positive_int(text: str) -> int:
    """Parse a strictly positive int for argparse."""
    return _number(text, int)


def _directory(text: str) -> str:
    """Parse a directory path for argparse: one that can be used or created.

    Refused before anything runs: an empty path, a file, and a missing path
    whose nearest existing parent is a file or not writable.
    """
    if not text:
        raise argparse.ArgumentTypeError("must name a directory, received ''")
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(
            f"must be a directory (created if missing), received {text}, a file"
        )
    parent = os.path.abspath(text)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        what = "a file" if not os.path.isdir(parent) else "not writable"
        exists = parent == os.path.abspath(text)
        verb = "cannot be written to" if exists else "cannot be created"
        raise argparse.ArgumentTypeError(f"{verb}: {parent} is {what}, received {text}")
    return text


def build_parser() -> argparse.ArgumentParser:
    """Return the parser of the `python -m keras_amp_plus` command line."""
    parser = argparse.ArgumentParser(
        prog="python -m keras_amp_plus",
        description="keras_amp_plus: mixed precision tools for Keras on Intel CPUs.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    doctor = commands.add_parser(
        "doctor", help="check this machine and recommend a dtype policy"
    )
    doctor.add_argument("--json", action="store_true", help="print JSON")
    doctor.add_argument(
        "--probe-seconds",
        type=_positive_float,
        default=2.0,
        help="time budget of the matmul probe (default: 2.0)",
    )

    demo = commands.add_parser(
        "demo",
        help="train a small model as float32, bfloat16 and float16, compare them",
    )
    demo.add_argument(
        "--log-dir",
        type=_directory,
        default="logs/demo",
        help=(
            "TensorBoard log directory (default: logs/demo); a previous demo's "
            "run directories in it are replaced"
        ),
    )
    demo.add_argument(
        "--epochs", type=_positive_int, default=None, help="default: 5 (2 with --quick)"
    )
    demo.add_argument(
        "--quick", action="store_true", help="less data, one block, 2 epochs"
    )
    return parser


def main(argv: list | None = None) -> int:
    """Run one command and return its exit code.

    Args:
        argv: arguments without the program name. Defaults to `sys.argv[1:]`.
    """
    args = build_parser().parse_args(argv)
    from keras_amp_plus.cli import _doctor as doctor

    if args.command == "doctor":
        return doctor.main(json_output=args.json, probe_seconds=args.probe_seconds)
    problems = doctor.stack_problems()  # said as the doctor says them, no traceback
    for problem in problems:
        print(f"keras_amp_plus demo: {problem}", file=sys.stderr)
    if problems:
        return 1
    from keras_amp_plus.cli import _demo as demo

    return demo.main(log_dir=args.log_dir, epochs=args.epochs, quick=args.quick)


__all__ = ["build_parser", "main"]

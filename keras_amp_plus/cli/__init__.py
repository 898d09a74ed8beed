"""Command line: `python -m keras_amp_plus {doctor,demo}`.

- `doctor [--json] [--probe-seconds S]`: versions, oneDNN, CPU low-precision
  features, devices, XLA, a matmul probe and a dtype policy recommendation.
- `demo --log-dir DIR [--epochs N] [--policy P]`: a short training run with the
  keras_amp_plus layers, loss scaler and AMPMonitor, writing TensorBoard logs.

The benchmarks live in the repository's `benchmarks/` (`make bench`).
Each command imports Keras and TensorFlow only when it runs, so `doctor` can
report a wrong backend or a broken install.
"""

import argparse


def _positive_float(text: str) -> float:
    """Parse a strictly positive float for argparse."""
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, received {text}")
    return value


def _positive_int(text: str) -> int:
    """Parse a strictly positive int for argparse."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive, received {text}")
    return value


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

    demo = commands.add_parser("demo", help="train a small model, log to TensorBoard")
    demo.add_argument("--log-dir", required=True, help="TensorBoard log directory")
    demo.add_argument("--epochs", type=_positive_int, default=3, help="default: 3")
    demo.add_argument(
        "--policy",
        choices=("mixed_bfloat16", "mixed_float16", "float32"),
        default="mixed_bfloat16",
        help="Keras dtype policy (default: mixed_bfloat16)",
    )
    return parser


def main(argv: list | None = None) -> int:
    """Run one command and return its exit code.

    Args:
        argv: arguments without the program name. Defaults to `sys.argv[1:]`.
    """
    args = build_parser().parse_args(argv)
    if args.command == "doctor":
        from keras_amp_plus.cli import doctor

        return doctor.main(json_output=args.json, probe_seconds=args.probe_seconds)
    from keras_amp_plus import demo

    return demo.main(log_dir=args.log_dir, epochs=args.epochs, policy=args.policy)


__all__ = ["build_parser", "main"]

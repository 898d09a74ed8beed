"""`python -m keras_amp_plus bench`: run the benchmark scripts of a source checkout.

The benchmarks live in `benchmarks/` next to the package in the git repository;
they are not installed with the wheel. Each script prints a table and writes
JSON to `benchmarks/results/`.
"""

import pathlib
import subprocess
import sys

BENCHMARK_SCRIPTS = ("layers.py", "loss_scale.py", "monitor.py")


def find_benchmarks_dir() -> pathlib.Path | None:
    """Return the `benchmarks/` directory of a source checkout, or None."""
    checkout = pathlib.Path(__file__).resolve().parent.parent
    candidate = checkout / "benchmarks"
    is_checkout = (checkout / "pyproject.toml").is_file()
    return candidate if is_checkout and candidate.is_dir() else None


def main(quick: bool = False, benchmarks_dir: pathlib.Path | None = None) -> int:
    """Run every benchmark script that exists, one after the other.

    Args:
        quick: pass `--quick` to each script. Defaults to `False`.
        benchmarks_dir: where the scripts are. Defaults to the checkout's
            `benchmarks/` directory.

    Returns:
        0 when every script ran and succeeded; 1 when there was nothing to run
        or a script failed.
    """
    directory = benchmarks_dir or find_benchmarks_dir()
    if directory is None:
        print(
            "keras_amp_plus bench: no benchmarks/ directory next to the package. "
            "The benchmarks ship with the source checkout only: clone the "
            "repository and run `python -m keras_amp_plus bench` from it.",
            file=sys.stderr,
        )
        return 1
    scripts = [directory / name for name in BENCHMARK_SCRIPTS]
    present = [script for script in scripts if script.is_file()]
    for missing in sorted(set(scripts) - set(present)):
        print(f"keras_amp_plus bench: {missing} not found, skipped", file=sys.stderr)
    if not present:
        return 1
    failures = []
    for script in present:
        command = [sys.executable, str(script), *(["--quick"] if quick else [])]
        print(f"$ {' '.join(command)}", flush=True)
        if subprocess.run(command, check=False).returncode != 0:
            failures.append(script.name)
    if failures:
        print(f"keras_amp_plus bench: failed: {', '.join(failures)}", file=sys.stderr)
    return 1 if failures else 0

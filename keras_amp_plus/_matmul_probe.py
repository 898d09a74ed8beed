"""A short measurement of matmul throughput in float32, bfloat16 and float16.

Matmuls are where mixed precision saves time, so their speed in each dtype on
this machine is the evidence for choosing a dtype policy. The dtypes are timed
interleaved, round after round, and each figure is the median over rounds, so a
burst of load from other processes hits every dtype alike. The speed-up against
float32 is a ratio of process CPU time (`time.process_time`), which other
processes on a shared machine do not inflate; TFLOP/s are per wall-clock second,
the figure users know.
"""

import statistics
import time
from collections.abc import Sequence

import tensorflow as tf

DEFAULT_DTYPES = ("float32", "bfloat16", "float16")


def _make_operands(size: int, dtype: str):
    """Return two random `(size, size)` matrices of `dtype`, values in [-1, 1)."""
    generator = tf.random.Generator.from_seed(1234)
    shape = (size, size)
    left = generator.uniform(shape, minval=-1.0, maxval=1.0)
    right = generator.uniform(shape, minval=-1.0, maxval=1.0)
    return tf.cast(left, dtype), tf.cast(right, dtype)


@tf.function
def _matmul_and_reduce(left, right):
    # Reducing to a scalar and reading it back waits for asynchronous devices
    # (GPU, XPU) at an O(n^2) cost, negligible against the O(n^3) matmul.
    return tf.reduce_sum(tf.cast(tf.matmul(left, right), "float32"))


def _time_calls(left, right, calls: int) -> tuple:
    """Return (wall seconds, CPU seconds) per call over `calls` calls."""
    wall_start, cpu_start = time.perf_counter(), time.process_time()
    for _ in range(calls):
        _matmul_and_reduce(left, right).numpy()
    wall = (time.perf_counter() - wall_start) / calls
    cpu = (time.process_time() - cpu_start) / calls
    return wall, cpu


def _plan(estimate: float, share: float, rounds: int) -> tuple:
    """Return (rounds, calls per round) that fit `share` seconds for one dtype."""
    estimate = max(estimate, 1e-6)
    planned_rounds = int(min(rounds, max(1, share // estimate)))
    calls = max(1, int(share / (planned_rounds * estimate)))
    return planned_rounds, calls


def probe_matmul_throughput(
    seconds: float = 2.0,
    size: int = 1024,
    dtypes: Sequence[str] = DEFAULT_DTYPES,
    rounds: int = 5,
) -> dict:
    """Measure square-matmul throughput per dtype on the default device.

    Each dtype is traced and run twice (warm-up), then timed in up to `rounds`
    interleaved rounds sized so the whole probe takes about `seconds`. A dtype
    whose matmul is so slow that one call exceeds its share of the time gets
    fewer rounds rather than stretching the probe.

    Args:
        seconds: time budget for the timed part, in seconds. Defaults to `2.0`.
        size: side of the square matrices. Defaults to `1024`.
        dtypes: dtypes to measure; speed-ups are relative to `"float32"`, which
            should be among them. Defaults to `("float32", "bfloat16", "float16")`.
        rounds: maximum number of interleaved rounds. Defaults to `5`.

    Returns:
        A dict: `"size"`, `"seconds"`, `"device"`, `"speedup_basis"`
        (`"cpu_time"` on a CPU, `"wall_time"` on an accelerator), and `"results"`
        mapping each
        dtype to `{"wall_ms", "cpu_ms", "tflops", "rounds", "calls_per_round",
        "speedup_vs_float32"}`, or to `{"error": message}` when TensorFlow has no
        kernel for that dtype here.
    """
    if seconds <= 0 or size <= 0 or rounds <= 0:
        raise ValueError(
            "`seconds`, `size` and `rounds` must be positive. "
            f"Received: seconds={seconds}, size={size}, rounds={rounds}"
        )
    operands, estimates, results = {}, {}, {}
    device = None
    for dtype in dtypes:
        try:
            left, right = _make_operands(size, dtype)
            _time_calls(left, right, 1)  # traces and runs once
            estimates[dtype] = _time_calls(left, right, 1)[0]
            operands[dtype] = (left, right)
            device = device or left.device
        except (tf.errors.OpError, TypeError, ValueError) as error:
            results[dtype] = {"error": f"{type(error).__name__}: {error}"}
    share = seconds / max(1, len(operands))
    plans = {d: _plan(estimates[d], share, rounds) for d in operands}
    samples = {dtype: [] for dtype in operands}
    for round_index in range(rounds):
        for dtype, (planned_rounds, calls) in plans.items():
            if round_index < planned_rounds:
                samples[dtype].append(_time_calls(*operands[dtype], calls))
    flops = 2.0 * size**3
    for dtype, timings in samples.items():
        wall = statistics.median(t[0] for t in timings)
        cpu = statistics.median(t[1] for t in timings)
        results[dtype] = {
            "wall_ms": wall * 1e3,
            "cpu_ms": cpu * 1e3,
            "tflops": flops / wall / 1e12,
            "rounds": plans[dtype][0],
            "calls_per_round": plans[dtype][1],
        }
    # Host CPU time says nothing about an accelerator's work: compare wall time.
    on_cpu = device is None or "CPU" in device.upper()
    basis = "cpu_ms" if on_cpu else "wall_ms"
    _add_speedups(results, basis)
    return {
        "size": size,
        "seconds": seconds,
        "device": device,
        "speedup_basis": "cpu_time" if on_cpu else "wall_time",
        "results": results,
    }


def _add_speedups(results: dict, basis: str) -> None:
    """Add `speedup_vs_float32`, a ratio of `basis` times (None without float32)."""
    baseline = results.get("float32", {}).get(basis)
    for result in results.values():
        if basis in result:
            elapsed = max(result[basis], 1e-9)
            result["speedup_vs_float32"] = baseline / elapsed if baseline else None

"""AMPMonitor and LossScaleOptimizer under MultiWorkerMirroredStrategy.

Two worker processes on 127.0.0.1, started (and always stopped, within a
bounded time) by `examples/multi_worker.py`'s launcher. The model's layer
`hot` overflows float16 on worker 1's data only: worker 0 never sees an Inf
of its own, so every agreement below comes from values reduced across the
workers.
"""

import importlib.util
import json
import os

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "multi_worker.py")

pytestmark = [pytest.mark.multi_worker, pytest.mark.slow]


def load_example():
    spec = importlib.util.spec_from_file_location("multi_worker_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def read_jsonl(log_dir):
    with open(os.path.join(log_dir, "amp_events.jsonl")) as f:
        return [json.loads(line) for line in f]


def worker_env():
    pythonpath = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=pythonpath, TF_CPP_MIN_LOG_LEVEL="2")


def run_workers(example, log_dir, epochs=2):
    argv = [example.sys.executable, EXAMPLE, "--epochs", str(epochs)]
    argv += ["--log-dir", log_dir]
    results = example.launch(argv, timeout=120, env=worker_env())
    return example.summaries(results)


def test_two_workers_agree_and_only_the_chief_logs(tmp_path):
    example = load_example()
    log_dir = str(tmp_path / "logs-{worker}")
    chief_dir, other_dir = log_dir.format(worker=0), log_dir.format(worker=1)
    chief, other = run_workers(example, log_dir)

    # Same weights, same lists, the same change at the same epoch.
    assert chief["checksum"] == other["checksum"]
    assert chief["lists"] == other["lists"]
    assert chief["deny_per_epoch"] == other["deny_per_epoch"] == [["hot"], ["hot"]]
    assert chief["overflow_events"] == other["overflow_events"]
    assert (chief["skipped_steps"], chief["total_steps"]) == (
        other["skipped_steps"],
        other["total_steps"],
    )
    # Validation and `evaluate` run too, their losses reduced over the workers.
    # (epoch 0's validation runs `hot` in float16 still: Inf or NaN.)
    np.testing.assert_array_equal(chief["val_loss"], other["val_loss"])
    np.testing.assert_array_equal(chief["evaluate_loss"], other["evaluate_loss"])
    assert np.isfinite(chief["val_loss"][-1]) and np.isfinite(chief["evaluate_loss"])
    assert len(chief["val_loss"]) == 2
    # Non-chief workers write nothing into their log_dir.
    assert not os.path.exists(other_dir) or os.listdir(other_dir) == []

    records = read_jsonl(chief_dir)
    overflows = [r for r in records if r["type"] == "overflow"]
    steps = [r["step"] for r in overflows]
    assert len(steps) == len(set(steps)) == sum(chief["overflow_events"])
    assert chief["skipped_steps"] == len(steps)
    forward = [r for r in overflows if r["direction"] == "forward"]
    # Worker 1's rows 8..15 overflow `hot` at the workers' steps 3 and 4; the
    # chief's own batches are finite there, its replay finds nothing, and the
    # layer comes from worker 1's replay.
    assert [(r["step"], r["layers"]) for r in forward] == [
        (3, ["hot"]),
        (4, ["hot"]),
    ]
    assert all(r["evidence"] == "replay of another worker's batch" for r in forward)
    changes = [r for r in records if r["type"] == "list_change"]
    assert [(c["epoch"], c["name"], c["to"]) for c in changes] == [(0, "hot", "deny")]
    assert os.path.isdir(os.path.join(chief_dir, "amp"))


def test_example_runs_with_one_shared_log_dir(tmp_path, capsys):
    example = load_example()
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    saved = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = worker_env()["PYTHONPATH"]
    try:
        results = example.main(["--quick", "--log-dir", str(tmp_path)])
    finally:
        if saved is None:
            os.environ.pop("PYTHONPATH")
        else:
            os.environ["PYTHONPATH"] = saved
    output = capsys.readouterr().out
    assert "identical lists and weights on every worker: True" in output
    assert output.count("deny layers ['hot']") == 2
    # Both workers log into one directory: each step is still written once.
    steps = [r["step"] for r in read_jsonl(str(tmp_path)) if r["type"] == "overflow"]
    assert len(steps) == len(set(steps)) == results[0]["skipped_steps"]


def test_workers_given_different_log_dirs_stop_with_a_clear_error(tmp_path):
    # Each worker reads the monitor's record from its `log_dir`: with one
    # per worker, a second run finds the chief's earlier run on the chief
    # only, and the workers would keep different lists. Both stop at once.
    example = load_example()
    argv = [example.sys.executable, EXAMPLE, "--quick"]
    argv += ["--log-dir", str(tmp_path / "logs-{worker}")]
    first = example.launch(argv, timeout=120, env=worker_env())
    assert [code for code, _, _ in first] == [0, 0]
    second = example.launch(argv, timeout=120, env=worker_env())
    # The launcher stops a worker still tearing down once the other exited;
    # each had raised (none hung in a collective), none trained.
    assert 0 not in [code for code, _, _ in second]
    for _, _, err in second:
        assert "AMPMonitor's workers found different records" in err

"""`python -m keras_amp_plus`: argument parsing, broken stacks, the demo."""

import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest

from keras_amp_plus import demo
from keras_amp_plus.cli import build_parser, doctor


def _run_module(*args, env_updates=None, timeout=300):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **(env_updates or {})}
    return subprocess.run(
        [sys.executable, "-m", "keras_amp_plus", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


def test_parser_defaults():
    parser = build_parser()
    doctor = parser.parse_args(["doctor"])
    assert (doctor.json, doctor.probe_seconds) == (False, 2.0)
    run = parser.parse_args(["demo", "--log-dir", "logs"])
    assert (run.log_dir, run.epochs, run.policy) == ("logs", 3, "mixed_bfloat16")


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["doctor", "--probe-seconds", "0"],
        ["doctor", "--probe-seconds", "-1"],
        ["demo"],
        ["demo", "--log-dir", "logs", "--epochs", "0"],
        ["demo", "--log-dir", "logs", "--policy", "mixed_int8"],
        ["cure"],
        ["bench"],  # benchmarks run from the checkout: `make bench`
    ],
)
def test_parser_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_doctor_refuses_a_non_tensorflow_backend(monkeypatch, capsys):
    monkeypatch.setattr(keras.backend, "backend", lambda: "jax")
    assert doctor.main(probe_seconds=0.1) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "'jax' backend" in captured.err
    assert "KERAS_BACKEND=tensorflow" in captured.err


def test_doctor_main_rejects_a_non_positive_probe():
    with pytest.raises(ValueError, match="Received: probe_seconds=0"):
        doctor.main(probe_seconds=0)


def test_broken_tensorflow_install_exits_non_zero(tmp_path):
    # A `tensorflow` package that fails to import shadows the real one.
    fake = tmp_path / "tensorflow"
    fake.mkdir()
    (fake / "__init__.py").write_text(
        "raise ImportError('simulated broken TensorFlow install')\n"
    )
    completed = _run_module("doctor", env_updates={"PYTHONPATH": str(tmp_path)})
    assert completed.returncode != 0
    assert completed.stdout == ""
    assert "simulated broken TensorFlow install" in completed.stderr


def test_unusable_keras_backend_exits_non_zero():
    # The numpy backend is not importable without SciPy here, and would be
    # refused by the package otherwise: either way, no report and a failure.
    completed = _run_module("doctor", env_updates={"KERAS_BACKEND": "numpy"})
    assert completed.returncode != 0
    assert completed.stdout == ""
    assert completed.stderr.strip()


def test_demo_data_is_learnable_and_reproducible():
    inputs, labels = demo.make_data(samples=256, seed=3)
    again_inputs, again_labels = demo.make_data(samples=256, seed=3)
    np.testing.assert_array_equal(inputs, again_inputs)
    np.testing.assert_array_equal(labels, again_labels)
    assert set(np.unique(labels)) <= set(range(demo.CLASSES))
    # More than one class occurs, so a constant guess cannot reach 100 %.
    assert len(np.unique(labels)) > 1


def _scalar_tags(run_dir: pathlib.Path) -> set:
    from tensorboard.backend.event_processing import event_accumulator

    accumulator = event_accumulator.EventAccumulator(str(run_dir))
    accumulator.Reload()
    return set(accumulator.Tags()["scalars"]) | set(accumulator.Tags()["tensors"])


@pytest.mark.parametrize("policy", ["mixed_bfloat16", "mixed_float16"])
def test_demo_writes_tensorboard_logs(tmp_path, policy):
    log_dir = tmp_path / "logs"
    completed = _run_module(
        "demo", "--log-dir", str(log_dir), "--epochs", "1", "--policy", policy
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    runs = {path.parent for path in log_dir.rglob("events.out.tfevents.*")}
    assert {log_dir / "train", log_dir / "validation"} <= runs
    assert "epoch_loss" in _scalar_tags(log_dir / "train")
    assert f"tensorboard --logdir {log_dir}" in completed.stdout
    overflow_line = next(
        line for line in completed.stdout.splitlines() if "overflow steps:" in line
    )
    overflow_steps = int(overflow_line.split("overflow steps:")[1].split()[0])
    if policy == "mixed_float16":
        # The demo starts the loss scale at 2**24: float16 gradients overflow.
        assert overflow_steps > 0

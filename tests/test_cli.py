"""`python -m keras_amp_plus`: argument parsing, broken stacks, the demo."""

import json
import os
import pathlib
import subprocess
import sys

import keras
import numpy as np
import pytest

from keras_amp_plus.cli import _demo as demo
from keras_amp_plus.cli import _doctor as doctor
from keras_amp_plus.cli import build_parser


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
    run = parser.parse_args(["demo"])
    assert (run.log_dir, run.epochs, run.quick) == ("logs/demo", None, False)


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["doctor", "--probe-seconds", "0"],
        ["doctor", "--probe-seconds", "-1"],
        ["demo", "--epochs", "0"],
        ["demo", "--epochs", "abc"],
        ["demo", "--epochs", "1.5"],
        ["doctor", "--probe-seconds", "nan"],
        ["doctor", "--probe-seconds", "inf"],
        ["demo", "--log-dir", ""],
        ["demo", "--policy", "mixed_float16"],
        ["cure"],
        ["bench"],  # benchmarks run from the checkout: `make bench`
    ],
)
def test_parser_rejects_bad_arguments(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(argv)
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "error:" in error and "invalid _" not in error  # no private names


def test_demo_refuses_a_log_dir_that_is_a_file(tmp_path, capsys):
    a_file = tmp_path / "logs"
    a_file.write_text("not a directory")
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["demo", "--log-dir", str(a_file)])
    assert exit_info.value.code == 2
    assert "--log-dir: must be a directory" in capsys.readouterr().err


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
    assert completed.returncode == 1
    assert completed.stdout == ""
    # Reported, with the CPU facts that need no TensorFlow: no traceback.
    assert "Traceback" not in completed.stderr
    assert (
        "keras_amp_plus doctor: TensorFlow cannot be imported (ImportError: "
        "simulated broken TensorFlow install)" in completed.stderr
    )
    assert "keras_amp_plus doctor: CPU: {" in completed.stderr


def test_unusable_keras_backend_exits_non_zero():
    # The numpy backend is not importable without SciPy here, and would be
    # refused by the package otherwise: either way, no report and a failure.
    completed = _run_module("doctor", env_updates={"KERAS_BACKEND": "numpy"})
    assert completed.returncode == 1
    assert completed.stdout == ""
    assert "Traceback" not in completed.stderr
    assert "keras_amp_plus doctor: Keras" in completed.stderr
    assert "keras_amp_plus doctor: CPU: {" in completed.stderr


def test_demo_on_an_unusable_keras_backend_says_so_without_a_traceback():
    completed = _run_module("demo", "--quick", env_updates={"KERAS_BACKEND": "numpy"})
    assert completed.returncode == 1
    assert completed.stdout == ""
    assert "Traceback" not in completed.stderr
    assert "keras_amp_plus demo: Keras" in completed.stderr


def test_demo_data_is_learnable_and_reproducible():
    inputs, labels = demo.make_data(samples=256, seed=3)
    again_inputs, again_labels = demo.make_data(samples=256, seed=3)
    np.testing.assert_array_equal(inputs, again_inputs)
    np.testing.assert_array_equal(labels, again_labels)
    assert set(np.unique(labels)) <= set(range(demo.CLASSES))
    # More than one class occurs, so a constant guess cannot reach 100 %.
    assert len(np.unique(labels)) > 1
    # Another seed is labelled by the same teacher: a linear fit of one
    # predicts the other (test data measures learning, not a new task).
    other_inputs, other_labels = demo.make_data(samples=256, seed=4)
    onehot = np.eye(demo.CLASSES)[labels]
    weights = np.linalg.lstsq(inputs.mean(axis=1), onehot, rcond=None)[0]
    predicted = np.argmax(other_inputs.mean(axis=1) @ weights, axis=-1)
    assert np.mean(predicted == other_labels) > 0.6  # chance: about 0.25


def _table_rows(stdout: str) -> dict:
    """Return `{run: [cells...]}` from the table the demo prints last."""
    lines = stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("run "))
    rows = {}
    for line in lines[header + 1 : header + 4]:
        run, steps, speedup, loss, accuracy, overflows, changes = line.split(maxsplit=6)
        rows[run] = {
            "steps_per_second": float(steps),
            "speedup": float(speedup.rstrip("x")),
            "loss": float(loss),
            "accuracy": float(accuracy),
            "overflows": overflows,
            "changes": changes,
        }
    return rows


def _read_jsonl(path: pathlib.Path) -> list:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
@pytest.mark.parametrize("onednn", ["default", "off"])
def test_demo_quick_shows_the_payoff_and_the_rescue(tmp_path, onednn):
    log_dir = tmp_path / "logs"
    env = {"TF_ENABLE_ONEDNN_OPTS": "0"} if onednn == "off" else {}
    completed = _run_module(
        "demo", "--quick", "--log-dir", str(log_dir), env_updates=env
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    out = completed.stdout
    rows = _table_rows(out)
    assert list(rows) == ["float32", "mixed_bfloat16", "mixed_float16"]
    assert rows["float32"]["speedup"] == 1.0
    for row in rows.values():
        # Every run learned: finite held-out loss, better than chance (4 classes).
        assert np.isfinite(row["loss"]) and row["steps_per_second"] > 0
        assert row["accuracy"] > 0.25
    assert rows["float32"]["overflows"] == "-"
    assert rows["mixed_bfloat16"]["overflows"] == "0"
    assert rows["mixed_bfloat16"]["changes"] == "-"
    # The float16 run: every step of the first epoch overflowed in `embed`,
    # which the monitor moved to float32 after it.
    steps_per_epoch = demo.TRAIN_SAMPLES["quick"] // demo.BATCH_SIZE
    assert rows["mixed_float16"]["overflows"] == str(steps_per_epoch)
    assert rows["mixed_float16"]["changes"] == "embed -> deny (epoch 0)"
    records = _read_jsonl(log_dir / "mixed_float16" / "amp_events.jsonl")
    overflows = [r for r in records if r["type"] == "overflow"]
    assert {tuple(r["layers"]) for r in overflows} == {("embed",)}
    # The check doctor makes decides whether bfloat16 pays, and says so.
    assert "low-precision check (as in `doctor`):" in out
    if onednn == "off":
        assert "oneDNN is off" in out
        assert "bfloat16 does not pay on this CPU" in out
    assert f"tensorboard --logdir {log_dir}" in out
    # Each run has its TensorBoard logs; the mixed ones an `amp` run.
    for run in rows:
        assert any((log_dir / run / "train").glob("events.out.tfevents.*"))
    for run in ("mixed_bfloat16", "mixed_float16"):
        assert any((log_dir / run / "amp").glob("events.out.tfevents.*"))


def test_demo_refuses_a_log_dir_it_cannot_create(tmp_path, capsys):
    a_file = tmp_path / "logs"
    a_file.write_text("not a directory")
    with pytest.raises(SystemExit) as exit_info:
        build_parser().parse_args(["demo", "--log-dir", str(a_file / "run")])
    assert exit_info.value.code == 2
    assert f"cannot be created: {a_file} is a file" in capsys.readouterr().err


def test_demo_leaves_a_folder_it_did_not_write_and_says_why(tmp_path, capsys):
    mine = tmp_path / "float32" / "mydata.txt"
    mine.parent.mkdir()
    mine.write_text("precious")
    (tmp_path / "mixed_float16" / "amp").mkdir(parents=True)
    assert demo.main(log_dir=str(tmp_path), epochs=1, quick=True) == 2
    assert mine.read_text() == "precious"
    assert (tmp_path / "mixed_float16" / "amp").is_dir()  # nothing deleted
    error = capsys.readouterr().err
    assert str(mine) in error and "another --log-dir" in error


def test_demo_takes_what_a_killed_monitor_left_for_its_own(tmp_path):
    run = tmp_path / "mixed_float16"
    run.mkdir()
    for name in ("amp_state.json.tmp", "amp_events.jsonl.tmp", "amp_events.jsonl"):
        (run / name).write_text("")
    assert demo.foreign_entries(str(tmp_path)) == []


def test_demo_replaces_only_its_own_previous_runs_and_says_so(tmp_path, capsys):
    (tmp_path / "mixed_float16" / "amp").mkdir(parents=True)
    (tmp_path / "mixed_float16" / "amp" / "old").write_text("old run")
    (tmp_path / "mine.txt").write_text("a user's file")
    demo.clear_previous_runs(str(tmp_path))
    assert not (tmp_path / "mixed_float16").exists()
    assert (tmp_path / "mine.txt").read_text() == "a user's file"
    replaced = capsys.readouterr().out.splitlines()
    assert replaced == [f"Replacing the previous demo run {tmp_path / 'mixed_float16'}"]


def test_demo_table_compares_with_float32():
    rows = [
        {
            "policy": "float32",
            "steps_per_second": 4.0,
            "test_loss": 0.5,
            "test_accuracy": 0.8,
            "overflow_events": None,
            "list_changes": [],
        },
        {
            "policy": "mixed_float16",
            "steps_per_second": 6.0,
            "test_loss": 0.6,
            "test_accuracy": 0.7,
            "overflow_events": 6,
            "list_changes": ["embed -> deny (epoch 0)"],
        },
    ]
    lines = demo.format_table(rows).splitlines()
    assert lines[1].split() == ["float32", "4.00", "1.00x", "0.5000", "0.800", "-", "-"]
    assert lines[2].split()[:6] == [
        "mixed_float16",
        "6.00",
        "1.50x",
        "0.6000",
        "0.700",
        "6",
    ]
    assert lines[2].endswith("embed -> deny (epoch 0)")

"""Shared fixtures: every test leaves global state as it found it.

Tests marked `onednn` need TensorFlow's oneDNN kernels (the grappler bfloat16
rewrite does nothing without them). oneDNN is read once, when TensorFlow is
imported, and is off by default on CPUs without AVX512 (or with
`TF_ENABLE_ONEDNN_OPTS=0`). When it is off in this process, the marked tests of
each module run together in one subprocess with `TF_ENABLE_ONEDNN_OPTS=1`, and
each reports its own outcome here: every machine runs them, whatever the
environment holds. Tests of the oneDNN-off behaviour start their own
subprocess with it off (`run_python` below).
"""

import json
import os
import subprocess
import sys
import tempfile

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import pytest

from keras_amp_plus import _compat
from keras_amp_plus.engines.grappler import (
    capture_global_state,
    put_back_global_state,
)

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
RESULTS_VARIABLE = "KERAS_AMP_PLUS_TEST_RESULTS"
ONEDNN_ON = _compat.onednn_enabled() is not False


def run_python(code: str, timeout: float = 300, **environment) -> str:
    """Run `code` in a fresh Python with extra environment; return its stdout.

    Fails the test with the child's output when it exits non-zero.
    """
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "2", **environment}
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"child exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


@pytest.fixture(autouse=True)
def restore_keras_state():
    """Reset the global dtype policy and the Keras session after each test."""
    policy = keras.config.dtype_policy()
    yield
    keras.config.set_dtype_policy(policy)
    keras.backend.clear_session()


@pytest.fixture(autouse=True)
def restore_grappler_state():
    """Grappler options and list variables are process-global: put them back."""
    state = capture_global_state()
    yield
    put_back_global_state(*state)


# -- running `onednn` tests in a subprocess when this process has it off -------
def pytest_configure(config):
    config.addinivalue_line(
        "markers",
        "onednn: needs TensorFlow's oneDNN kernels (run in a subprocess with "
        "TF_ENABLE_ONEDNN_OPTS=1 when this process has them off)",
    )


def pytest_runtest_logreport(report):
    """In a delegated subprocess, write each phase's outcome for the parent."""
    path = os.environ.get(RESULTS_VARIABLE)
    if path is None:
        return
    skip_reason = None
    if report.skipped and isinstance(report.longrepr, tuple):
        skip_reason = report.longrepr[2]
    record = {
        "nodeid": report.nodeid,
        "when": report.when,
        "outcome": report.outcome,
        "text": str(report.longrepr) if report.failed else skip_reason,
    }
    with open(path, "a", encoding="utf-8") as file:
        file.write(json.dumps(record) + "\n")


class _OneDnnSubprocess:
    """Runs the `onednn` tests of one module in one subprocess, once."""

    def __init__(self, rootdir, nodeids):
        self.rootdir, self.nodeids, self.results = rootdir, nodeids, None

    def run(self) -> dict:
        if self.results is None:
            self.results = self._run()
        return self.results

    def _run(self) -> dict:
        with tempfile.TemporaryDirectory() as directory:
            path = os.path.join(directory, "results.jsonl")
            env = {**os.environ, "TF_ENABLE_ONEDNN_OPTS": "1", RESULTS_VARIABLE: path}
            command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
            done = subprocess.run(
                [*command, *self.nodeids],
                cwd=self.rootdir,
                env=env,
                capture_output=True,
                text=True,
                check=False,
            )
            results = {}
            if os.path.exists(path):
                with open(path, encoding="utf-8") as file:
                    for line in file:
                        record = json.loads(line)
                        results.setdefault(record["nodeid"], []).append(record)
        results["__output__"] = done.stdout[-4000:] + done.stderr[-4000:]
        return results


def _run_delegated(item, runner):
    records = runner.run().get(item.nodeid)
    if not records:
        pytest.fail(
            "The oneDNN subprocess did not run this test:\n"
            + runner.run()["__output__"]
        )
    for record in records:
        if record["outcome"] == "failed":
            pytest.fail(
                f"[run with TF_ENABLE_ONEDNN_OPTS=1 in a subprocess, {record['when']}]"
                f"\n{record['text']}",
                pytrace=False,
            )
    for record in records:
        if record["outcome"] == "skipped":
            pytest.skip(record["text"] or "skipped in the oneDNN subprocess")


def pytest_collection_modifyitems(config, items):
    if ONEDNN_ON or os.environ.get(RESULTS_VARIABLE):
        return
    by_module = {}
    for item in items:
        if item.get_closest_marker("onednn") is not None:
            by_module.setdefault(item.nodeid.split("::")[0], []).append(item)
    for module_items in by_module.values():
        runner = _OneDnnSubprocess(
            str(config.rootpath), [item.nodeid for item in module_items]
        )
        for item in module_items:
            item.runtest = lambda item=item, runner=runner: _run_delegated(item, runner)

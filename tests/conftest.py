"""Shared fixtures: every test leaves global state as it found it.

Stack markers: `keras3` tests need Keras 3 (stock TensorFlow >= 2.16); `itex`
tests need the ITEX stack (TensorFlow 2.15 + Keras 2.15 + Intel Extension for
TensorFlow); `itex_bfloat16` tests also need ITEX's bfloat16 kernels, which a
subprocess probe checks (on CPUs without AVX512 the first bfloat16 MatMul
aborts the process). Each is skipped elsewhere with the reason.

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
from keras_amp_plus.engines._grappler import (
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


def nested_model():
    """Return `outer`: d1 -> `inner` Sequential (a, ln) -> head, in the policy."""
    inner = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(4, name="a"),
            keras.layers.LayerNormalization(name="ln"),
        ],
        name="inner",
    )
    inputs = keras.Input((4,))
    outputs = keras.layers.Dense(2, name="head")(
        inner(keras.layers.Dense(4, name="d1")(inputs))
    )
    return keras.Model(inputs, outputs, name="outer")


# The lean suite of the ITEX stack (`make test-itex`): the stack-specific tests
# plus the layer / scaler / monitor core, written against `_compat`. The other
# modules use Keras 3 APIs directly (`keras.config`, `keras.ops`, layer paths,
# Keras 3's scaler attributes) and are skipped on Keras 2 with that reason.
KERAS2_MODULES = (
    "test_engines_itex.py",
    "test_itex_amp.py",
    "test_itex_configs.py",
    "test_itex_layers.py",
    "test_itex_loss_scale.py",
    "test_itex_probe.py",
)


def pytest_collection_modifyitems(config, items):
    _skip_the_other_stack(items)
    _delegate_onednn_tests(config, items)


def _skip_the_other_stack(items):
    """Skip the tests of the other stack, with the reason."""
    itex_reason = None
    for item in items:
        if not _compat.IS_KERAS_3 and item.path.name not in KERAS2_MODULES:
            item.add_marker(pytest.mark.keras3)
        if "keras3" in item.keywords and not _compat.IS_KERAS_3:
            item.add_marker(
                pytest.mark.skip(
                    reason="written against Keras 3 APIs; on the ITEX stack "
                    f"(keras=={keras.__version__}) `make test-itex` runs the "
                    "test_itex_* suite"
                )
            )
        needs_itex = "itex" in item.keywords or "itex_bfloat16" in item.keywords
        if needs_itex and _compat.itex_module() is None:
            item.add_marker(
                pytest.mark.skip(
                    reason="needs Intel Extension for TensorFlow (the ITEX "
                    "stack: `make test-itex`)"
                )
            )
            continue
        if "itex_bfloat16" in item.keywords:
            if itex_reason is None:
                from keras_amp_plus import _itex_probe

                status = _itex_probe.itex_bfloat16_status()
                itex_reason = "" if status["works"] else status["reason"]
            if itex_reason:
                item.add_marker(
                    pytest.mark.skip(
                        reason=f"ITEX bfloat16 kernels do not work here: {itex_reason}"
                    )
                )


@pytest.fixture(autouse=True)
def restore_keras_state():
    """Reset the global dtype policy and the Keras session after each test."""
    policy = _compat.global_policy()
    yield
    _compat.set_global_policy(policy)
    # Without Python's full garbage collection, which costs 0.4-9 s per test
    # as the suite's heap grows; the automatic collector still runs.
    if _compat.IS_KERAS_3:
        keras.backend.clear_session(free_memory=False)
    else:
        keras.backend.clear_session()


@pytest.fixture(autouse=True)
def restore_grappler_state():
    """Grappler options and list variables are process-global: put them back."""
    state = capture_global_state()
    yield
    put_back_global_state(*state)


@pytest.fixture(autouse=True)
def restore_itex_config():
    """ITEX's config is process-global: put it back after every test."""
    itex = _compat.itex_module()
    if itex is None:
        yield
        return
    saved = type(itex.get_config())()
    saved.CopyFrom(itex.get_config())
    yield
    itex.set_config(saved)


# -- running `onednn` tests in a subprocess when this process has it off -------
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


def _delegate_onednn_tests(config, items):
    """With oneDNN off here, run `onednn` tests in a subprocess with it on."""
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

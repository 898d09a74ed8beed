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
import re
import subprocess
import sys
import tempfile
import textwrap
import warnings

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import numpy as np
import pytest
import tensorflow as tf

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

    Fails the test with the child's output when it exits non-zero. A child
    killed by a signal while no thread of it ran Python code (a crash inside
    one of TensorFlow's own threads) runs once more, with a warning that
    carries the first crash's output. TensorFlow 2.21 has such a crash: the
    background thread of a MirroredStrategy input pipeline
    (`MultiDeviceIterator::MultiDeviceBuffer::BackgroundThread`) calls
    `GetNext` on the iterator of the `fit` that just ended, freed (a core
    dump's backtrace; one child in 15 under load, at the start of the next
    `fit`). A crash that happens every time repeats, and fails; an
    intermittent one in TensorFlow's threads, whatever causes it, passes
    with that warning in pytest's summary.
    """
    # faulthandler: a native crash in the child (SIGSEGV) prints every
    # thread's Python stack into the failure message instead of only "-11".
    env = {
        **os.environ,
        "TF_CPP_MIN_LOG_LEVEL": "2",
        "PYTHONFAULTHANDLER": "1",
        **environment,
    }
    done = _run_child(code, env, timeout)
    if _crashed_outside_python(done):
        warnings.warn(
            f"child killed by signal {-done.returncode} in a native thread; "
            f"ran it again. Its output:\n{done.stderr[-6000:]}",
            stacklevel=2,
        )
        done = _run_child(code, env, timeout)
    if done.returncode != 0:
        pytest.fail(f"child exited {done.returncode}:\n{done.stdout}\n{done.stderr}")
    return done.stdout


def _run_child(code, env, timeout):
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
        check=False,
    )


def _crashed_outside_python(done) -> bool:
    """Return True when a signal killed the child outside any Python frame.

    faulthandler heads the stack of the thread that crashed with "Current
    thread"; when the crash hit a thread running no Python code, it lists
    the Python threads as "Thread" only.
    """
    return (
        done.returncode < 0
        and "Fatal Python error" in done.stderr
        and "Current thread" not in done.stderr
    )


TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_TWO_CPUS_PREAMBLE = f"""
import json, sys
import tensorflow as tf
cpu = tf.config.list_physical_devices("CPU")[0]
tf.config.set_logical_device_configuration(
    cpu, [tf.config.LogicalDeviceConfiguration()] * 2
)
sys.path.insert(0, {TESTS_DIR!r})
strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
"""


def run_on_two_cpus(body: str, timeout: float = 300):
    """Run `body` where `strategy` mirrors two logical CPUs; return its last JSON.

    Logical devices must be set before TensorFlow initialises, so this runs
    in a fresh Python (with `json`, `sys`, `tf` and `strategy` defined, and
    this directory importable for the shared scenario).
    """
    stdout = run_python(
        _TWO_CPUS_PREAMBLE + textwrap.dedent(body),
        timeout=timeout,
        PYTHONPATH=os.path.dirname(TESTS_DIR),
    )
    return json.loads(stdout.strip().splitlines()[-1])


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
    "test_itex_jit_probe.py",
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
def end_unfinished_fits():
    """A monitored `fit` a test stopped outside its steps ends after the test.

    As the process's next `fit` would end it (`_unfinished_fits`); torn down
    before the global state above is compared and put back.
    """
    yield
    from keras_amp_plus.callbacks import _unfinished_fits

    for reference, _ in list(_unfinished_fits._unfinished):
        session = reference()
        if session is not None:
            session.abort()
    _unfinished_fits._unfinished.clear()


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


# -- the overflow scenario the monitor tests share ----------------------------
BATCH, SAMPLES = 16, 128
STEPS_PER_EPOCH = SAMPLES // BATCH


def overflow_model(policy, scaler="ours", hot_scale=3e4, **scaler_kwargs):
    """Return a compiled model whose layer `hot` overflows float16.

    `hot` is a Dense with a large fixed (non-trainable) kernel: its outputs are
    about 1e5, fine in float32 and Inf in float16 (max 65504). The
    LayerNormalization after it brings them back to order 1, so once `hot` runs
    in float32 the rest of the model trains in float16 without trouble.
    """
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4,))
    h = keras.layers.Dense(8, name="d1")(inputs)
    h = keras.layers.Dense(
        16,
        name="hot",
        trainable=False,
        kernel_initializer=keras.initializers.RandomNormal(stddev=hot_scale, seed=1),
    )(h)
    h = keras.layers.LayerNormalization(name="ln")(h)
    outputs = keras.layers.Dense(1, name="head")(h)
    model = keras.Model(inputs, outputs)
    from keras_amp_plus.optimizers import LossScaleOptimizer

    optimizer = keras.optimizers.Adam(0.1)
    if scaler == "ours":
        optimizer = LossScaleOptimizer(optimizer, **scaler_kwargs)
    elif scaler == "guard":
        optimizer = LossScaleOptimizer.guard(optimizer)
    # scaler "keras": compile wraps Adam in Keras's scaler under mixed_float16.
    model.compile(optimizer, loss="mse", auto_scale_loss=(scaler == "keras"))
    return model


def regression_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(SAMPLES, 4)).astype("float32")
    w = np.array([[1.0], [2.0], [-1.0], [0.5]])
    y = np.tanh(x @ w) + 0.3 * rng.normal(size=(SAMPLES, 1))
    return x, y.astype("float32")


def train(model, callbacks, epochs=5, **fit_kwargs):
    x, y = regression_data()
    return model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=callbacks,
        **fit_kwargs,
    )


def read_jsonl(log_dir):
    with open(os.path.join(log_dir, "amp_events.jsonl")) as f:
        return [json.loads(line) for line in f]


def read_tensorboard(log_dir):
    from tensorboard.backend.event_processing import event_accumulator

    accumulator = event_accumulator.EventAccumulator(
        os.path.join(log_dir, "amp"), size_guidance={"tensors": 0}
    )
    accumulator.Reload()
    return accumulator


def scalar_series(accumulator, tag):
    """Return `{step: value}` of a tf.summary scalar (stored as a tensor)."""
    return {
        event.step: float(tf.make_ndarray(event.tensor_proto))
        for event in accumulator.Tensors(tag)
    }


def text_values(accumulator, tag):
    return [
        tf.make_ndarray(event.tensor_proto).item().decode()
        for event in accumulator.Tensors(tag)
    ]


# -- float64 references of the layers' outputs and gradients -----------------
# One rounding of the output: 2**-8 relative for bfloat16 (8 significant bits),
# 2**-11 for float16, 2**-24 for float32; on top of it the float32 arithmetic
# inside may be off by FLOAT32_SLOP of the tensor's largest value, scaled by how
# far the inputs sit from zero (N(1000, 1) inputs lose ~3 digits to their own
# float32 spacing before any statistics are taken).
ROUNDING = {"float32": 2.0**-24, "float16": 2.0**-11, "bfloat16": 2.0**-8}
FLOAT32_SLOP = 2.0**-20


@pytest.fixture
def empty_path_cache(tmp_path, monkeypatch):
    """No measured paths unless a test writes them (the user's cache is not read)."""
    monkeypatch.setenv("KERAS_AMP_PLUS_CACHE_DIR", str(tmp_path))


def use_policy(name):
    keras.config.set_dtype_policy(name)
    return keras.config.dtype_policy()


def float_inputs(shape, mean, dtype, seed=0):
    """Random N(mean, 1) inputs already in `dtype`, and their float64 values."""
    rng = np.random.default_rng(seed)
    x = tf.cast(tf.constant(rng.normal(mean, 1.0, shape)), dtype)
    upstream = tf.cast(tf.constant(rng.normal(0.0, 1.0, shape)), dtype)
    return x, upstream, as_float64(x), as_float64(upstream)


def as_float64(tensor):
    return np.asarray(tf.cast(tensor, tf.float64))


def assert_close(actual, expected, dtype, what, float32_scale=1.0):
    """Within one rounding of `dtype` of each value, plus float32 slop."""
    actual = as_float64(actual) if not isinstance(actual, np.ndarray) else actual
    slop = FLOAT32_SLOP * float32_scale * np.abs(expected).max()
    tolerance = ROUNDING[dtype] * np.abs(expected) + slop
    error = np.abs(actual - expected)
    worst = np.unravel_index(np.argmax(error - tolerance), error.shape)
    assert np.all(error <= tolerance), (
        f"{what}: error {error[worst]:.3g} > tolerance {tolerance[worst]:.3g} "
        f"at {worst} (expected {expected[worst]:.6g}, got {actual[worst]:.6g})"
    )


def normalization_reference(x, upstream, gamma, beta, epsilon, stat_axes):
    """Return output and gradients (x, gamma, beta) of a normalization in float64."""
    mean = x.mean(axis=stat_axes, keepdims=True)
    centered = x - mean
    inverse_stddev = 1.0 / np.sqrt(
        (centered**2).mean(axis=stat_axes, keepdims=True) + epsilon
    )
    normalized = centered * inverse_stddev
    outputs = normalized * gamma + beta
    param_axes = tuple(a for a in range(x.ndim) if gamma.shape[a] == 1)
    gamma_grad = (upstream * normalized).sum(axis=param_axes, keepdims=True)
    beta_grad = upstream.sum(axis=param_axes, keepdims=True)
    scaled = upstream * gamma
    x_grad = inverse_stddev * (
        scaled
        - scaled.mean(axis=stat_axes, keepdims=True)
        - normalized * (scaled * normalized).mean(axis=stat_axes, keepdims=True)
    )
    return outputs, x_grad, gamma_grad, beta_grad


def run_layer(layer, x, upstream):
    with tf.GradientTape() as tape:
        tape.watch(x)
        outputs = layer(x)
    sources = [x, *layer.trainable_weights]
    grads = tape.gradient(outputs, sources, output_gradients=upstream)
    return outputs, grads


def second_order_reference(x, upstream, direction, gamma, beta, stat_axes):
    """d/dx of sum(x_gradient(x) * direction), by central differences in float64.

    `upstream` is an array, or a function of the outputs: the gradient of a
    loss of them, which then depends on x too.
    """
    step, second = 1e-5, np.zeros_like(x)
    for index in np.ndindex(x.shape):
        shifted = []
        for sign in (1.0, -1.0):
            moved = x.copy()
            moved[index] += sign * step
            incoming = upstream
            if callable(upstream):
                outputs = normalization_reference(
                    moved, np.zeros_like(x), gamma, beta, 1e-3, stat_axes
                )[0]
                incoming = upstream(outputs)
            x_grad = normalization_reference(
                moved, incoming, gamma, beta, 1e-3, stat_axes
            )[1]
            shifted.append((x_grad * direction).sum())
        second[index] = (shifted[0] - shifted[1]) / (2 * step)
    return second


def penalty_gradients(step, x, upstream, direction):
    """Return a layer's x gradient and the gradient of `<x_grad, direction>`.

    Both tapes outside the step, as a gradient penalty (WGAN-GP, R1) takes them.
    """
    with tf.GradientTape() as outer:
        outer.watch(x)
        with tf.GradientTape() as inner:
            inner.watch(x)
            outputs = step(x)
        x_grad = inner.gradient(outputs, x, output_gradients=upstream)
        penalty = tf.reduce_sum(x_grad * direction)
    return x_grad, outer.gradient(penalty, x)


def set_random_weights(layer, seed=1):
    rng = np.random.default_rng(seed)
    for weight in layer.weights:
        weight.assign(
            rng.normal(1.0 if weight.name == "gamma" else 0.0, 0.3, weight.shape)
        )


def check_normalization(layer, shape, mean, policy, stat_axes, param_shape):
    compute = policy.compute_dtype
    x, upstream, x64, upstream64 = float_inputs(shape, mean, compute)
    layer.build(shape)
    set_random_weights(layer)
    gamma = np.reshape(as_float64(layer.gamma), param_shape)
    beta = np.reshape(as_float64(layer.beta), param_shape)
    outputs, (x_grad, gamma_grad, beta_grad) = run_layer(layer, x, upstream)
    assert outputs.dtype == compute and x_grad.dtype == compute
    assert gamma_grad.dtype == "float32" and beta_grad.dtype == "float32"
    ref = normalization_reference(
        x64, upstream64, gamma, beta, layer.epsilon, stat_axes
    )
    # float32 inputs near 1000 are spaced 2**-14 = 64 * FLOAT32_SLOP apart.
    far = 1.0 + mean / 8.0
    assert_close(outputs, ref[0], compute, "outputs", far)
    assert_close(x_grad, ref[1], compute, "x gradient", far)
    # Weight gradients are float32 sums of products of the compute-dtype tensors.
    assert_close(
        np.reshape(as_float64(gamma_grad), param_shape),
        ref[2],
        "float32",
        "gamma gradient",
        64 * far,
    )
    assert_close(
        np.reshape(as_float64(beta_grad), param_shape),
        ref[3],
        "float32",
        "beta gradient",
        64,
    )


def check_swish(outputs, grads, x, upstream64, beta, compute, trainable_beta):
    """Assert a Swish's outputs and gradients against the float64 reference."""
    outputs64, x_grad64, beta_grad64 = swish_reference(as_float64(x), upstream64, beta)
    assert outputs.dtype == compute and grads[0].dtype == compute
    assert_close(outputs, outputs64, compute, "outputs")
    assert_close(grads[0], x_grad64, compute, "x gradient")
    if trainable_beta:
        assert grads[1].dtype == "float32"
        beta_grad = np.array(as_float64(grads[1]))
        assert_close(beta_grad, np.array(beta_grad64), "float32", "beta gradient", 256)


def swish_reference(x, upstream, beta):
    sigmoid = 1.0 / (1.0 + np.exp(-beta * x))
    outputs = x * sigmoid
    x_grad = upstream * sigmoid * (1.0 + beta * x * (1.0 - sigmoid))
    beta_grad = (upstream * x**2 * sigmoid * (1.0 - sigmoid)).sum()
    return outputs, x_grad, beta_grad


def xla_step(layer, shape, input_signature=None):
    """Forward + backward of `layer` in one `jit_compile=True` function.

    `layer` is built for `shape` first, so its weights exist before the trace.
    """
    layer.build(shape)

    @tf.function(jit_compile=True, input_signature=input_signature)
    def step(x, upstream):
        with tf.GradientTape() as tape:
            tape.watch(x)
            outputs = layer(x)
        sources = [x, *layer.trainable_weights]
        return outputs, tape.gradient(outputs, sources, output_gradients=upstream)

    return step


class InXlaStep:
    """`layer` called inside a `jit_compile=True` function, as a model calls it.

    Traced for inputs of `shape`, or with `any_batch` for any batch size (as
    `fit` traces a `tf.data` pipeline without `drop_remainder`). Everything
    else (build, weights, gamma, beta, epsilon) is the layer's.
    """

    def __init__(self, layer, shape, any_batch):
        self.inner = layer
        signature = None
        if any_batch:
            signature = [tf.TensorSpec((None, *shape[1:]), layer.compute_dtype)]
        self.call_in_step = tf.function(
            lambda x: layer(x), jit_compile=True, input_signature=signature
        )

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def __call__(self, x):
        return self.call_in_step(x)


def hlo_without_names(hlo):
    """Return optimized HLO text without the names that differ between traces."""
    hlo = re.sub(r", metadata=\{[^}]*\}", "", hlo)
    hlo = re.sub(r"(HloModule|ENTRY) \S+", r"\1", hlo)
    return re.sub(r"%[\w.]+", "%name", hlo)


def counting_runs(function, ran, key):
    """`function`, appending `key` to the list `ran` whenever it runs."""

    def record():
        ran.append(key)
        return np.int32(0)

    def counted(*args):
        # A Python callback, not a variable: the layer's `tf.custom_gradient`
        # refuses functions that touch variables it was not handed.
        with tf.control_dependencies([tf.numpy_function(record, [], tf.int32)]):
            first, *rest = function(*args)
            return (tf.identity(first), *rest)

    return counted


def normalization_step(layer, spec):
    """A graph step of `layer` for inputs of `spec`: outputs and the gradients.

    The gradients w.r.t. the input, `gamma` and `beta`, for a given upstream
    gradient (the step's second argument, of the same spec).
    """

    @tf.function(input_signature=[spec, spec])
    def step(x, upstream):
        with tf.GradientTape() as tape:
            tape.watch(x)
            outputs = layer(x)
        sources = [x, layer.gamma, layer.beta]
        return outputs, tape.gradient(outputs, sources, output_gradients=upstream)

    return step

"""AMPMonitor on small real models: a CNN and a transformer block.

Each model overflows float16 in one place on purpose, fine in float32, with a
normalization after it that brings values back to order 1: (a) a Dense with a
large fixed kernel, (b) a weightless `Activation` (exponential of a shifted
input), (c) the attention scores inside `MultiHeadAttention` (large queries and
keys: the scores, computed between its sublayers, overflow), (d) a Dense inside
a nested `Sequential`. Each runs with `jit_compile` off and on: the right layer
is named (by its name chain) and denied, every other layer stays float16, and
the final loss is within 5% (of the starting loss) of the same model trained in
float32 with as many applied updates (the first epoch's steps are all skipped
in float16).
"""

import json
import logging
import os

import keras
import numpy as np
import pytest
from conftest import run_python

from keras_amp_plus.callbacks import AMPMonitor
from keras_amp_plus.optimizers import LossScaleOptimizer

BATCH, SAMPLES, EPOCHS = 16, 96, 8
STEPS = SAMPLES // BATCH


def _hot_dense(name):
    return keras.layers.Dense(
        8,
        name=name,
        trainable=False,
        # Outputs of order 1e6: beyond float16 (65504) with any matmul kernel
        # (with 3e4 they sat near the limit, and Eigen's kernels stayed finite).
        kernel_initializer=keras.initializers.RandomNormal(stddev=3e5, seed=1),
    )


def cnn(culprit):
    """A small CNN; `culprit` picks where float16 overflows."""
    inputs = keras.Input((6, 6, 1))
    h = keras.layers.Conv2D(4, 3, padding="same", name="conv")(inputs)
    if culprit == "dense":
        h = _hot_dense("hot")(h)
    elif culprit == "activation":
        h = keras.layers.Rescaling(1.0, offset=12.0, name="shift")(h)
        h = keras.layers.Activation("exponential", name="hot")(h)
    elif culprit == "nested":
        backbone = keras.Sequential(
            [keras.layers.Dense(8, name="pre"), _hot_dense("hot")], name="backbone"
        )
        h = backbone(h)
    h = keras.layers.LayerNormalization(name="ln")(h)
    # Average pooling: TensorFlow's Eigen max pooling (oneDNN off) drops NaNs,
    # which would hide the forward overflow from the loss (see the notes).
    h = keras.layers.AveragePooling2D(2, name="pool")(h)
    h = keras.layers.GlobalAveragePooling2D(name="gap")(h)
    outputs = keras.layers.Dense(1, name="head")(h)
    return keras.Model(inputs, outputs, name="cnn")


class SubclassedCNN(keras.Model):
    """The nested CNN as a subclassed model: its layers are built by a call."""

    def __init__(self):
        super().__init__(name="subclassed")
        self.conv = keras.layers.Conv2D(4, 3, padding="same", name="conv")
        self.backbone = keras.Sequential(
            [keras.layers.Dense(8, name="pre"), _hot_dense("hot")], name="backbone"
        )
        self.ln = keras.layers.LayerNormalization(name="ln")
        self.pool = keras.layers.AveragePooling2D(2, name="pool")
        self.gap = keras.layers.GlobalAveragePooling2D(name="gap")
        self.head = keras.layers.Dense(1, name="head")

    def call(self, x):
        h = self.ln(self.backbone(self.conv(x)))
        return self.head(self.gap(self.pool(h)))


def subclassed_cnn(culprit):
    """`SubclassedCNN`, built on a batch as AMPMonitor asks (`culprit` unused)."""
    del culprit
    model = SubclassedCNN()
    model(np.zeros((1, 6, 6, 1), "float32"))
    return model


def transformer(culprit):
    """A small transformer block; `culprit` picks where float16 overflows."""
    inputs = keras.Input((4, 8))
    h = keras.layers.Dense(8, name="embed")(inputs)
    boost = 400.0 if culprit == "attention" else 1.0
    h = keras.layers.Rescaling(boost, name="boost")(h)
    attention = keras.layers.MultiHeadAttention(
        2,
        8,
        name="attention",
        kernel_initializer=keras.initializers.GlorotUniform(seed=2),
    )(h, h)
    h = keras.layers.LayerNormalization(name="ln1")(attention + h)
    if culprit == "dense":
        h = _hot_dense("hot")(h)
    h = keras.layers.LayerNormalization(name="ln2")(h)
    h = keras.layers.Dense(16, activation="relu", name="ff")(h)
    h = keras.layers.GlobalAveragePooling1D(name="gap")(h)
    outputs = keras.layers.Dense(1, name="head")(h)
    return keras.Model(inputs, outputs, name="transformer")


CASES = {
    "cnn-dense": (cnn, "dense", "hot"),
    "cnn-activation": (cnn, "activation", "hot"),
    "cnn-nested": (cnn, "nested", "backbone/hot"),
    "cnn-subclassed": (subclassed_cnn, "nested", "backbone/hot"),
    "transformer-attention": (transformer, "attention", "attention"),
    "transformer-dense": (transformer, "dense", "hot"),
}


def data(build):
    rng = np.random.default_rng(0)
    shape = (4, 8) if build is transformer else (6, 6, 1)
    x = rng.normal(size=(SAMPLES, *shape)).astype("float32")
    y = np.tanh(x.reshape(SAMPLES, -1).mean(axis=1, keepdims=True) * 3)
    return x, y.astype("float32")


def fit(build, culprit, policy, jit_compile, callbacks=(), epochs=EPOCHS):
    keras.config.set_dtype_policy(policy)
    keras.utils.set_random_seed(0)
    model = build(culprit)
    optimizer = keras.optimizers.Adam(0.01)
    if policy == "mixed_float16":
        # The floor action is the scaler's business (tested with it).
        optimizer = LossScaleOptimizer(optimizer, on_min_scale="ignore")
    model.compile(optimizer, "mse", jit_compile=jit_compile)
    x, y = data(build)
    history = model.fit(
        x,
        y,
        batch_size=BATCH,
        epochs=epochs,
        shuffle=False,
        verbose=0,
        callbacks=list(callbacks),
    )
    return model, history


def leaf_dtypes(model):
    from keras_amp_plus._lists.layer_names import layer_chains

    chains = layer_chains(model)
    return {
        chains[id(layer)]: layer.compute_dtype
        for layer in model._flatten_layers(include_self=False)
        if id(layer) in chains and not isinstance(layer, keras.Model)
    }


@pytest.mark.parametrize(
    "jit_compile", [False, pytest.param(True, marks=pytest.mark.slow)]
)
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_culprit_is_named_and_denied_and_training_recovers(
    case, jit_compile, tmp_path
):
    build, culprit, expected = CASES[case]
    log_dir = str(tmp_path)
    monitor = AMPMonitor(log_dir, read_every_steps=3, patience=50)
    model, history = fit(build, culprit, "mixed_float16", jit_compile, [monitor])
    # Skipped steps (all of the first epoch; the scaler's search after the
    # scale is put back) apply no update: float32 gets as many updates.
    skipped_epochs = round(sum(history.history["overflow_events"]) / STEPS)
    _, reference = fit(
        build, culprit, "float32", jit_compile, epochs=EPOCHS - skipped_epochs
    )

    with open(os.path.join(log_dir, "amp_events.jsonl")) as f:
        records = [json.loads(line) for line in f]
    # Attributed: forward, or backward at a trusted scale. After the denial
    # the scale is put back and the scaler may search again (untrusted).
    attributed = [r for r in records if r["type"] == "overflow" and r["trusted"]]
    assert attributed, "the injected overflow never happened"
    assert {tuple(r["layers"]) for r in attributed} == {(expected,)}
    assert all(r["direction"] == "forward" for r in attributed)
    assert {r["epoch"] for r in attributed} == {0}
    assert monitor.lists.deny_layers == (expected,)
    dtypes = leaf_dtypes(model)
    denied = {c for c in dtypes if c == expected or c.startswith(expected + "/")}
    assert {dtypes[c] for c in denied} == {"float32"}
    assert {d for c, d in dtypes.items() if c not in denied} == {"float16"}
    restored = [r for r in records if r["type"] == "scale_restored"]
    assert [(r["epoch"], r["to"]) for r in restored] == [(0, 2.0**15)]
    final, final_reference = history.history["loss"][-1], reference.history["loss"][-1]
    # Recovered: the final loss is within 5% of float32's, measured against the
    # loss both started from. (Relative to the final loss alone, Adam's path
    # after one extra skipped step - the scaler's search once the scale is put
    # back - decides more than precision does at these small losses.)
    assert abs(final - final_reference) <= 0.05 * reference.history["loss"][0]


MAX_POOLING_CHILD = """
import json, os, sys
import numpy as np, keras
from keras_amp_plus import _compat
from keras_amp_plus.callbacks import AMPMonitor
from keras_amp_plus.optimizers import LossScaleOptimizer
assert _compat.onednn_enabled() is False, "the child must run with oneDNN off"

keras.config.set_dtype_policy("mixed_float16")
keras.utils.set_random_seed(0)
inputs = keras.Input((6, 6, 1))
h = keras.layers.Conv2D(
    4, 1, name="conv", trainable=False, kernel_initializer="ones")(inputs)
h = keras.layers.Rescaling(8.0, name="gain")(h)
# exp(8 x) > 65504 for x > 1.39: float16 overflows where the pixel is lit.
h = keras.layers.Activation("exponential", name="hot")(h)
h = keras.layers.LayerNormalization(name="ln")(h)
h = keras.layers.MaxPooling2D(2, name="pool")(h)
h = keras.layers.GlobalAveragePooling2D(name="gap")(h)
outputs = keras.layers.Dense(1, name="head")(h)
model = keras.Model(inputs, outputs, name="cnn")
optimizer = LossScaleOptimizer(
    keras.optimizers.Adam(0.01), initial_scale=4.0, on_min_scale="ignore")
model.compile(optimizer, "mse")
rng = np.random.default_rng(0)
x = np.zeros((48, 6, 6, 1), "float32")
# One lit pixel per 2x2 window: 'hot' overflows there only, and the max
# pooling keeps a finite neighbour of each NaN, so the loss stays finite.
x[:, ::2, ::2, :] = rng.uniform(1.5, 2.5, size=(48, 3, 3, 1))
y = np.tanh(x.reshape(48, -1).mean(axis=1, keepdims=True)).astype("float32")
monitor = AMPMonitor(sys.argv[1], read_every_steps=3)
history = model.fit(
    x, y, batch_size=4, epochs=2, shuffle=False, verbose=0, callbacks=[monitor])
with open(os.path.join(sys.argv[1], "amp_events.jsonl")) as f:
    records = [json.loads(line) for line in f]
print(json.dumps({
    "deny_layers": list(monitor.lists.deny_layers),
    "loss": history.history["loss"],
    "overflows": [r for r in records if r["type"] == "overflow"],
}))
"""


def test_a_forward_overflow_that_max_pooling_hides_from_the_loss_is_named(tmp_path):
    # With oneDNN off, TensorFlow's Eigen max pooling drops NaNs: the float16
    # overflow in 'hot' never reaches the loss and shows only as non-finite
    # gradients at the trusted scale, whose implicated layer closest to the
    # loss is 'ln'. The replay of those steps names 'hot'.
    out = run_python(
        MAX_POOLING_CHILD.replace("sys.argv[1]", repr(str(tmp_path))),
        TF_ENABLE_ONEDNN_OPTS="0",
    )
    result = json.loads(out.strip().splitlines()[-1])
    overflows = result["overflows"]
    trusted = [r for r in overflows if r["trusted"]]
    assert trusted, "no overflow at the trusted scale"
    assert {tuple(r["layers"]) for r in trusted} == {("hot",)}
    assert all(r["direction"] == "forward" for r in trusted)
    assert all("the loss stayed finite" in r["evidence"] for r in trusted)
    assert result["deny_layers"] == ["hot"]
    assert np.isfinite(result["loss"][-1])


def test_under_jit_compile_the_batch_is_stashed_outside_xla(monkeypatch):
    """The step and its recording run in XLA; the batch's stash around it.

    Inside XLA a conditional copies the batch-sized stash buffers on every
    step, taken or not; in the graph around it, an untaken one costs nothing.
    Validation stays compiled too, and the model's `jit_compile` reads True
    all along.
    """
    from keras_amp_plus import _compat
    from keras_amp_plus.callbacks import _step_recorder

    in_xla = {"layer": [], "stash": []}

    class Probe(keras.layers.Layer):
        def call(self, inputs):
            in_xla["layer"].append(_compat.in_xla_compiled_function())
            return inputs

    stash = _step_recorder.StepRecorder._stash

    def observed_stash(self, *args):
        in_xla["stash"].append(_compat.in_xla_compiled_function())
        return stash(self, *args)

    monkeypatch.setattr(_step_recorder.StepRecorder, "_stash", observed_stash)
    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4), Probe(), keras.layers.Dense(1)]
    )
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(), on_min_scale="ignore")
    model.compile(optimizer, "mse", jit_compile=True)
    during_fit = []
    watch = keras.callbacks.LambdaCallback(
        on_epoch_end=lambda epoch, logs: during_fit.append(model.jit_compile)
    )
    x = np.ones((32, 4), "float32")
    y = np.ones((32, 1), "float32")
    model.fit(
        x,
        y,
        epochs=2,
        verbose=0,
        validation_data=(x, y),
        callbacks=[AMPMonitor(None), watch],
    )
    assert in_xla["stash"] and not any(in_xla["stash"])
    # Traced once at build (no XLA), once in the train step, once in validation.
    assert in_xla["layer"][-2:] == [True, True]
    assert during_fit == [True, True]
    assert model.jit_compile is True


def test_a_fit_interrupted_under_xla_leaves_no_xla_for_a_later_plain_fit():
    """A plain `fit` after a monitored one that raised runs the model's own step.

    The interrupt comes from a callback, outside the step: the plain `fit`
    ends the monitored one (`_unfinished_fits`) and traces the step without
    XLA, as the model is now compiled.
    """
    from keras_amp_plus import _compat

    traced_in_xla = []

    class Probe(keras.layers.Layer):
        def call(self, inputs):
            traced_in_xla.append(_compat.in_xla_compiled_function())
            return inputs

    class Interrupt(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            raise KeyboardInterrupt

    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(4), Probe(), keras.layers.Dense(1)]
    )
    model.compile(keras.optimizers.SGD(), "mse", jit_compile=True)
    x = np.ones((64, 4), "float32")
    y = np.ones((64, 1), "float32")
    with pytest.raises(KeyboardInterrupt):
        model.fit(
            x, y, batch_size=32, verbose=0, callbacks=[AMPMonitor(None), Interrupt()]
        )
    assert traced_in_xla[-1] is True
    model.compile(keras.optimizers.SGD(), "mse", jit_compile=False)
    traced_in_xla.clear()
    model.fit(x, y, batch_size=32, verbose=0)
    assert traced_in_xla == [False]


def _wide_then_nested(with_input):
    """A float32 layer's outputs of order 1e6 enter a nested model.

    With `keras.Input` the nested model hands them on as they are, and its
    first layer's cast to float16 overflows; without one, Keras built it for
    its first layer's float16 and casts them at its boundary.
    """
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inner = [keras.layers.Rescaling(1e-6, name="scale_in"), keras.layers.Dense(8)]
    if with_input:
        inner.insert(0, keras.Input((8,)))
    model = keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(
                8,
                name="wide",
                dtype="float32",
                trainable=False,
                kernel_initializer=keras.initializers.Constant(3e5),
            ),
            keras.Sequential(inner, name="backbone"),
            keras.layers.Dense(1, name="head"),
        ]
    )
    model.compile(LossScaleOptimizer(keras.optimizers.SGD(0.01)), "mse")
    return model


def _fit_with_monitor(model, log_dir, epochs):
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 1.0, (32, 4)).astype("float32")
    y = rng.normal(size=(32, 1)).astype("float32")
    monitor = AMPMonitor(log_dir, deny_threshold=1, patience=50)
    history = model.fit(
        x, y, batch_size=8, epochs=epochs, verbose=0, callbacks=[monitor]
    )
    with open(os.path.join(log_dir, "amp_events.jsonl")) as f:
        return monitor, history, [json.loads(line) for line in f]


def test_an_overflowing_cast_inside_a_nested_model_names_its_layer(tmp_path):
    # The nested model's output is the first non-finite output, but its
    # first layer's cast overflowed: that layer is denied, not every layer
    # of the nested model, and training goes on.
    model = _wide_then_nested(with_input=True)
    monitor, history, records = _fit_with_monitor(model, str(tmp_path), epochs=3)
    forward = [r for r in records if r.get("direction") == "forward"]
    assert {tuple(r["layers"]) for r in forward} == {("backbone/scale_in",)}
    assert all(r["evidence"].endswith("input_cast") for r in forward)
    assert {r["epoch"] for r in forward} == {0}
    assert monitor.lists.deny_layers == ("backbone/scale_in",)
    assert np.isfinite(history.history["loss"][-1])
    dense = model.get_layer("backbone").layers[-1]
    assert dense.compute_dtype == "float16"


def test_an_overflowing_cast_after_a_float32_layer_inside_a_nested_model(tmp_path):
    # Inside the nested model a float32 layer hands 1e6 to a float16 one,
    # whose cast overflows: that layer is named (not the nested model, all
    # of whose layers would go to float32), as it is in a flat model.
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    wide = keras.layers.Dense(
        8,
        name="wide",
        dtype="float32",
        trainable=False,
        kernel_initializer=keras.initializers.Constant(3e5),
    )
    inner = keras.Sequential(
        [keras.Input((4,)), wide, keras.layers.Rescaling(1e-6, name="narrow")],
        name="backbone",
    )
    model = keras.Sequential(
        [keras.Input((4,)), inner, keras.layers.Dense(1, name="head")]
    )
    model.compile(LossScaleOptimizer(keras.optimizers.SGD(0.01)), "mse")
    monitor, history, records = _fit_with_monitor(model, str(tmp_path), epochs=2)
    forward = [r for r in records if r.get("direction") == "forward"]
    assert forward and {tuple(r["layers"]) for r in forward} == {("backbone/narrow",)}
    assert all(r["evidence"].endswith("input_cast") for r in forward)
    assert monitor.lists.deny_layers == ("backbone/narrow",)
    assert np.isfinite(history.history["loss"][-1])
    assert model.get_layer("head").compute_dtype == "float16"


def test_a_denial_that_cannot_take_effect_is_said_loudly(tmp_path, caplog):
    # Without `keras.Input` the nested model casts at its boundary, which no
    # dtype policy changes: the denied layer keeps overflowing, and the
    # monitor says so (once), in the log and in amp_events.jsonl.
    model = _wide_then_nested(with_input=False)
    with caplog.at_level(logging.WARNING, logger="keras_amp_plus"):
        monitor, history, records = _fit_with_monitor(model, str(tmp_path), epochs=3)
    assert monitor.lists.deny_layers == ("backbone",)
    assert history.history["overflow_events"][1:] == [4, 4]
    said = [r for r in records if r["type"] == "denial_without_effect"]
    assert [(r["epoch"], r["layer"]) for r in said] == [(1, "backbone")]
    warnings = [r.message for r in caplog.records if "still overflows" in r.message]
    assert len(warnings) == 1 and "keras.Input" in warnings[0]


class _SubclassedNet(keras.Model):
    """A subclassed model: its layers are created in `__init__`."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.dense = keras.layers.Dense(8, name="dense")
        self.head = keras.layers.Dense(1, dtype="float32", name="head")

    def call(self, inputs):
        return self.head(self.dense(inputs))


@pytest.mark.parametrize("model_dtype", [None, "float32"])
def test_a_subclassed_models_own_cast_is_named_with_its_fix(
    tmp_path, caplog, model_dtype
):
    # Inputs of order 1e5: under mixed_float16 the subclassed model casts
    # them to float16 in its own `__call__`, which denying `dense` cannot
    # reach. The warning names the fix; with it `dense`'s own cast overflows,
    # the denial takes effect and training goes on.
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    model = _SubclassedNet(dtype=model_dtype, name="net")
    rng = np.random.default_rng(0)
    x = rng.uniform(0.5, 1.0, (32, 4)).astype("float32") * 1e5
    model(x[:1])
    model.compile(LossScaleOptimizer(keras.optimizers.SGD(1e-12)), "mse")
    y = np.zeros((32, 1), "float32")
    monitor = AMPMonitor(str(tmp_path), deny_threshold=1, patience=50)
    with caplog.at_level(logging.WARNING, logger="keras_amp_plus"):
        history = model.fit(
            x, y, batch_size=8, epochs=3, verbose=0, callbacks=[monitor]
        )
    assert monitor.lists.deny_layers == ("dense",)
    warnings = [r.message for r in caplog.records if "still overflows" in r.message]
    if model_dtype is None:
        assert len(warnings) == 1 and 'dtype="float32"' in warnings[0]
    else:
        assert warnings == []
        assert np.isfinite(history.history["loss"][-1])


def _sequence_model(wrap):
    """`hot` overflows float16 on (4, 8) sequences, run by `wrap(hot)`."""
    keras.config.set_dtype_policy("mixed_float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 8))
    h = keras.layers.Dense(8, name="embed")(inputs)
    h = wrap(_hot_dense("hot"))(h)
    h = keras.layers.LayerNormalization(name="ln")(h)
    outputs = keras.layers.Dense(1, name="head")(keras.layers.Flatten()(h))
    model = keras.Model(inputs, outputs)
    optimizer = LossScaleOptimizer(keras.optimizers.Adam(0.01), on_min_scale="ignore")
    model.compile(optimizer, "mse")
    return model


def _fit_sequences(model, log_dir, caplog, epochs=3):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(32, 4, 8)).astype("float32")
    y = np.tanh(x.mean(axis=(1, 2)))[:, None].astype("float32")
    monitor = AMPMonitor(log_dir, deny_threshold=1, patience=50)
    with caplog.at_level(logging.WARNING, logger="keras_amp_plus"):
        history = model.fit(
            x, y, batch_size=8, epochs=epochs, verbose=0, callbacks=[monitor]
        )
    return monitor, history


def test_a_layer_time_distributed_runs_is_denied_through_the_wrapper(tmp_path, caplog):
    # Keras 3's TimeDistributed runs its layer by `call`, under the wrapper's
    # policy: the denial of 'td/hot' must reach the wrapper to take effect.
    model = _sequence_model(
        lambda layer: keras.layers.TimeDistributed(layer, name="td")
    )
    monitor, history = _fit_sequences(model, str(tmp_path), caplog)
    assert monitor.lists.deny_layers == ("td/hot",)
    # At most the scaler's search once the scale is put back, then none.
    assert history.history["overflow_events"][1] <= 1
    assert history.history["overflow_events"][2] == 0
    assert np.isfinite(history.history["loss"][2])
    wrapper = model.get_layer("td")
    assert (wrapper.compute_dtype, wrapper.layer.compute_dtype) == (
        "float32",
        "float32",
    )
    assert model.get_layer("ln").compute_dtype == "float16"
    assert not [r for r in caplog.records if "still overflows" in r.message]


class _RunsByCall(keras.layers.Layer):
    """A wrapper of a user's that runs its layer by `call`, as TimeDistributed."""

    def __init__(self, layer, **kwargs):
        super().__init__(**kwargs)
        self.layer = layer

    def build(self, input_shape):
        self.layer.build(input_shape)

    def call(self, inputs):
        return self.layer.call(inputs)


def test_a_denied_layer_run_under_another_policy_is_said_with_its_fix(tmp_path, caplog):
    # A wrapper the monitor does not know: the denial of 'wrap/hot' changes
    # nothing, and the warning says why (not that float32 diverges too).
    model = _sequence_model(lambda layer: _RunsByCall(layer, name="wrap"))
    monitor, history = _fit_sequences(model, str(tmp_path), caplog)
    assert monitor.lists.deny_layers == ("wrap/hot",)
    assert history.history["overflow_events"][1:] == [4, 4]
    warnings = [r.message for r in caplog.records if "still overflows" in r.message]
    assert len(warnings) == 1
    assert "Deny the layer around it" in warnings[0]
    assert "diverge" not in warnings[0]


def test_a_pure_float16_conv_that_overflows_is_named_and_training_goes_on(
    tmp_path, caplog
):
    # Its variables are float16: no Keras policy computes it in float32, so
    # the monitor says so before the first step and when it keeps
    # overflowing, and the next step runs (a Conv2D moved to float32 would
    # fail on its float16 kernel).
    keras.config.set_dtype_policy("float16")
    keras.utils.set_random_seed(0)
    inputs = keras.Input((4, 4, 1))
    hot = keras.layers.Conv2D(
        2,
        3,
        padding="same",
        name="hot",
        kernel_initializer=keras.initializers.Constant(3e4),
    )(inputs)
    outputs = keras.layers.Dense(1, name="head")(keras.layers.Flatten()(hot))
    model = keras.Model(inputs, outputs)
    model.compile(
        LossScaleOptimizer(keras.optimizers.SGD(), on_min_scale="ignore"), "mse"
    )
    x = np.ones((16, 4, 4, 1), "float32")
    y = np.zeros((16, 1), "float32")
    monitor = AMPMonitor(str(tmp_path), deny_threshold=1, patience=50)
    with caplog.at_level(logging.WARNING, logger="keras_amp_plus"):
        history = model.fit(
            x, y, batch_size=8, epochs=2, verbose=0, callbacks=[monitor]
        )
    assert history.history["overflow_events"] == [2, 2]
    assert monitor.lists.deny_layers == ("hot",)
    assert model.get_layer("hot").compute_dtype == "float16"
    messages = [r.message for r in caplog.records]
    assert any(
        "keep their variables in 16 bits" in m and "'hot'" in m for m in messages
    )
    (still,) = [m for m in messages if "still overflows" in m]
    assert "Its variables are 16-bit" in still

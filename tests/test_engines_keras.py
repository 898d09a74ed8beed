import keras
import numpy as np
import pytest
from conftest import nested_model

from keras_amp_plus._lists.layer_names import candidate_layers
from keras_amp_plus._lists.precision_lists import PrecisionLists
from keras_amp_plus.engines import KerasEngine, resolve_engine

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
LOW = {"float32": "bfloat16", "mixed_float16": "float16", "mixed_bfloat16": "bfloat16"}


def _model(policy):
    keras.config.set_dtype_policy(policy)
    model = nested_model()
    model.compile(optimizer="sgd", loss="mse")
    return model


def _data():
    rng = np.random.default_rng(0)
    return rng.normal(size=(8, 4)).astype("float32"), rng.normal(size=(8, 2))


def _compute_dtypes(model, leaves_only=False):
    return {
        layer.name: layer.compute_dtype
        for layer in candidate_layers(model)
        if not (leaves_only and isinstance(layer, keras.Model))
    }


def _lists(policy, deny):
    # Under a float32 global policy nothing is mixed yet: allow everything else.
    allow = (".*",) if policy == "float32" else ()
    return PrecisionLists(allow_layers=allow, deny_layers=(deny,))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize(
    ("deny", "denied"),
    [
        ("d1", {"d1"}),  # name
        ("inner/a", {"a"}),  # path
        ("inn.*/l.", {"ln"}),  # regular expression
        ("LayerNormalization", {"ln"}),  # class name
        ("inner", {"inner", "a", "ln"}),  # a nested model takes its layers along
    ],
)
def test_deny_keeps_that_layer_in_float32_and_survives_save(
    policy, deny, denied, tmp_path
):
    model = _model(policy)
    KerasEngine().apply(model, _lists(policy, deny))
    expected = {
        name: "float32" if name in denied else LOW[policy]
        for name in _compute_dtypes(model)
    }
    assert _compute_dtypes(model) == expected

    path = tmp_path / "model.keras"
    model.save(path)
    keras.config.set_dtype_policy("float32")  # loading must not depend on it
    loaded = keras.saving.load_model(path, compile=False)
    # Nested models do not save their own policy; the layers inside them do.
    leaves = {name: dtype for name, dtype in expected.items() if name != "inner"}
    assert _compute_dtypes(loaded, leaves_only=True) == leaves


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_apply_rebuilds_the_functions_and_fit_still_trains(policy):
    model = _model(policy)
    x, y = _data()
    model.fit(x, y, epochs=1, verbose=0)
    model.predict(x, verbose=0)
    old_train, old_predict = model.train_function, model.predict_function
    KerasEngine().apply(model, PrecisionLists(deny_layers=("ln", "head")))
    assert model.train_function is not old_train
    assert model.predict_function is not old_predict
    history = model.fit(x, y, epochs=1, verbose=0)
    assert np.isfinite(history.history["loss"][0])
    assert model.predict(x, verbose=0).dtype == np.float32


def test_applying_the_same_lists_again_keeps_the_traced_functions():
    model = _model("mixed_bfloat16")
    x, y = _data()
    lists = PrecisionLists(deny_layers=("ln", "head"))
    engine = KerasEngine()
    engine.apply(model, lists)
    model.fit(x, y, epochs=1, verbose=0)
    traced = model.train_function
    engine.apply(model, lists)  # as each `fit` with the monitor starts
    KerasEngine().apply(model, lists)  # a new engine object: same policies
    assert model.train_function is traced
    engine.apply(model, PrecisionLists(deny_layers=("ln",)))  # head: mixed again
    assert model.train_function is not traced
    assert model.get_layer("head").dtype_policy.name == "mixed_bfloat16"


def test_denied_dense_matches_a_float64_reference():
    keras.config.set_dtype_policy("mixed_bfloat16")
    model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(32, name="d")])
    x = np.random.default_rng(1).normal(size=(16, 64)).astype("float32")
    kernel, bias = (w.astype("float64") for w in model.layers[0].get_weights())
    reference = x.astype("float64") @ kernel + bias

    def relative_error():
        out = keras.ops.convert_to_numpy(model(x)).astype("float64")
        return np.max(np.abs(out - reference)) / np.max(np.abs(reference))

    assert relative_error() > 1e-4  # bfloat16 keeps ~3 significant digits
    KerasEngine().apply(model, PrecisionLists(deny_layers=("d",)))
    assert relative_error() < 1e-6


def test_moves_are_reversible():
    model = _model("mixed_bfloat16")
    engine = KerasEngine()
    engine.apply(model, PrecisionLists(deny_layers=("d1", "ln")))
    engine.apply(model, PrecisionLists(deny_layers=("ln",)))
    assert _compute_dtypes(model)["d1"] == "bfloat16"
    engine.apply(model, PrecisionLists())
    assert set(_compute_dtypes(model).values()) == {"bfloat16"}
    assert model.get_layer("d1").dtype_policy.name == "mixed_bfloat16"


def test_allow_uses_the_default_mixed_policy_on_a_float32_model():
    model = _model("float32")
    engine = KerasEngine()
    engine.apply(model, PrecisionLists(allow_layers=("head",)))
    assert model.get_layer("head").dtype_policy.name == "mixed_bfloat16"
    assert _compute_dtypes(model)["d1"] == "float32"


def test_the_most_specific_entry_wins():
    model = _model("float32")
    lists = PrecisionLists(allow_layers=("head",), deny_layers=("Dense",))
    KerasEngine().apply(model, lists)
    dtypes = _compute_dtypes(model)
    assert (dtypes["head"], dtypes["d1"], dtypes["a"]) == (
        "bfloat16",
        "float32",
        "float32",
    )


def test_op_lists_are_rejected_by_the_layer_engine():
    model = _model("mixed_bfloat16")
    with pytest.raises(ValueError, match=r"op-type lists need a graph engine.*'Mean'"):
        KerasEngine().apply(model, PrecisionLists(deny_ops=("Mean",)))


def test_an_unknown_entry_changes_nothing():
    model = _model("mixed_bfloat16")
    lists = PrecisionLists(deny_layers=("d1", "hed"))
    with pytest.raises(ValueError, match=r"'hed' matches no layer.*Did you mean head"):
        resolve_engine("keras", model).apply(model, lists)
    assert set(_compute_dtypes(model).values()) == {"bfloat16"}


class _DenyAfterFirstEpoch(keras.callbacks.Callback):
    """What AMPMonitor does: move a layer between epochs, inside `fit`."""

    def __init__(self, lists):
        super().__init__()
        self.engine, self.lists = KerasEngine(), lists
        self.functions, self.head_dtypes = [], []

    def on_epoch_begin(self, epoch, logs=None):
        self.functions.append(self.model.train_function)

    def on_train_batch_end(self, batch, logs=None):
        self.head_dtypes.append(self.model.get_layer("head").compute_dtype)

    def on_epoch_end(self, epoch, logs=None):
        if epoch == 0:
            self.engine.apply(self.model, self.lists)


@pytest.mark.parametrize("policy", ["mixed_float16", "mixed_bfloat16"])
def test_apply_between_epochs_inside_fit(policy):
    model = _model(policy)
    x, y = _data()
    callback = _DenyAfterFirstEpoch(PrecisionLists(deny_layers=("head",)))
    history = model.fit(x, y, batch_size=4, epochs=2, verbose=0, callbacks=[callback])
    assert callback.functions[0] is not callback.functions[1]
    assert callback.head_dtypes == [LOW[policy]] * 2 + ["float32"] * 2
    assert np.all(np.isfinite(history.history["loss"]))
    assert model.predict(x, verbose=0).dtype == np.float32


def _time_distributed_model():
    keras.config.set_dtype_policy("mixed_bfloat16")
    inputs = keras.Input((3, 4))
    hidden = keras.layers.TimeDistributed(keras.layers.Dense(4, name="d"), name="td")(
        inputs
    )
    return keras.Model(inputs, keras.layers.Dense(2, name="head")(hidden))


def test_denying_a_layer_time_distributed_runs_sets_the_wrappers_policy_too():
    # Keras 3's TimeDistributed runs its layer by `call`, under its own policy.
    model = _time_distributed_model()
    engine = KerasEngine()
    engine.apply(model, PrecisionLists(deny_layers=("td/d",)))
    wrapper = model.get_layer("td")
    assert (wrapper.compute_dtype, wrapper.layer.compute_dtype) == (
        "float32",
        "float32",
    )
    x = np.random.default_rng(0).normal(size=(2, 3, 4)).astype("float32")
    assert wrapper(x).dtype == "float32"
    assert model.get_layer("head").compute_dtype == "bfloat16"
    engine.apply(model, PrecisionLists())
    assert (wrapper.compute_dtype, wrapper.layer.compute_dtype) == (
        "bfloat16",
        "bfloat16",
    )


def test_an_allowed_layer_keeps_a_mixed_policy_of_its_own():
    # The user computes one layer in float16 inside a bfloat16 model: denied
    # and allowed back, it is float16 again, not the model's bfloat16.
    keras.config.set_dtype_policy("mixed_bfloat16")
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(4, dtype="mixed_float16", name="own")(inputs)
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(hidden))
    engine = KerasEngine()
    engine.apply(model, PrecisionLists(deny_layers=("own",)))
    assert model.get_layer("own").compute_dtype == "float32"
    engine.apply(model, PrecisionLists(allow_layers=("own", "head")))
    assert model.get_layer("own").dtype_policy.name == "mixed_float16"
    assert model.get_layer("head").dtype_policy.name == "mixed_bfloat16"
    engine.apply(model, PrecisionLists())
    assert model.get_layer("own").dtype_policy.name == "mixed_float16"


@pytest.mark.parametrize("pure", ["float16", "bfloat16"])
def test_a_model_of_a_pure_16_bit_policy_keeps_its_own_precisions(pure):
    # "float16" everywhere (16-bit variables): a layer without variables
    # denied and allowed back computes in float16 again, never in a bfloat16
    # nobody asked for; a float32 layer allowed computes in the model's 16
    # bits; one with 16-bit variables is not moved (no Keras policy computes
    # in float32 on them: Conv2D would fail).
    keras.config.set_dtype_policy(pure)
    inputs = keras.Input((4, 4, 2))
    hidden = keras.layers.Conv2D(2, 3, padding="same", name="conv")(inputs)
    hidden = keras.layers.Activation("relu", name="act")(hidden)
    hidden = keras.layers.Dense(2, name="f32", dtype="float32")(hidden)
    model = keras.Model(inputs, keras.layers.Dense(2, name="head")(hidden))
    engine = KerasEngine()
    engine.apply(model, PrecisionLists(deny_layers=("conv", "act")))
    assert model.get_layer("conv").dtype_policy.name == pure
    assert model.get_layer("act").compute_dtype == "float32"
    x = np.ones((2, 4, 4, 2), "float32")
    assert np.isfinite(keras.ops.convert_to_numpy(model(x)).astype("float32")).all()
    engine.apply(model, PrecisionLists(allow_layers=("act", "f32")))
    assert model.get_layer("act").dtype_policy.name == pure
    assert model.get_layer("f32").dtype_policy.name == f"mixed_{pure}"
    assert keras.ops.convert_to_numpy(model(x)).dtype == np.dtype(pure)
    assert resolve_engine("auto", model).name == "keras"


def test_a_layer_shared_with_time_distributed_is_denied_in_both_uses():
    keras.config.set_dtype_policy("mixed_float16")
    shared = keras.layers.Dense(4, name="s")
    inputs = keras.Input((3, 4))
    direct = shared(inputs)
    wrapped = keras.layers.TimeDistributed(shared, name="td")(inputs)
    model = keras.Model(inputs, keras.layers.Add(name="add")([direct, wrapped]))
    KerasEngine().apply(model, PrecisionLists(deny_layers=("s",)))
    x = np.ones((1, 3, 4), "float32")
    assert shared(x).dtype == "float32"
    assert model.get_layer("td")(x).dtype == "float32"
    assert model.get_layer("add").compute_dtype == "float16"


def test_a_time_distributed_inside_a_wrapped_model_owns_its_own_layer():
    # TimeDistributed(Sequential([TimeDistributed(Dense)])): the Sequential
    # calls the inner wrapper through `__call__`, under its own policy.
    keras.config.set_dtype_policy("mixed_float16")
    inner = keras.layers.TimeDistributed(keras.layers.Dense(4, name="d"), name="inner")
    block = keras.Sequential([keras.Input((2, 4)), inner], name="block")
    outer = keras.layers.TimeDistributed(block, name="outer")
    inputs = keras.Input((3, 2, 4))
    model = keras.Model(inputs, outer(inputs))
    KerasEngine().apply(model, PrecisionLists(deny_layers=("outer/block/inner/d",)))
    assert inner(np.ones((1, 2, 4), "float32")).dtype == "float32"
    assert outer.compute_dtype == "float16"

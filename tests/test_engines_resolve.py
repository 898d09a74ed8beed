import keras
import pytest
import tensorflow as tf

from keras_amp_plus import _compat
from keras_amp_plus._lists.precision_lists import PrecisionLists
from keras_amp_plus.engines import (
    GrapplerEngine,
    ItexEngine,
    KerasEngine,
    resolve_engine,
)
from keras_amp_plus.engines._resolve import check_engine_name


def _model(layer_dtype=None):
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(4, name="d1"),
            keras.layers.Dense(2, name="d2", dtype=layer_dtype),
        ]
    )


@pytest.mark.parametrize(
    ("name", "cls"),
    [("keras", KerasEngine), ("grappler", GrapplerEngine), ("itex", ItexEngine)],
)
def test_names_resolve_to_their_engines(name, cls):
    engine = resolve_engine(name, _model())
    assert type(engine) is cls
    assert engine.name == name
    assert engine.level == ("layer" if name == "keras" else "op")


def test_an_engine_instance_passes_through():
    engine = GrapplerEngine()
    assert resolve_engine(engine, _model()) is engine


def test_unknown_names_are_rejected():
    with pytest.raises(ValueError, match=r"Received: engine='xla'"):
        resolve_engine("xla", _model())


@pytest.mark.parametrize(
    ("policy", "layer_dtype", "expected"),
    [
        # A float32 model stays float32: auto never turns a rewrite on.
        ("float32", None, "keras"),
        ("mixed_bfloat16", None, "keras"),
        ("mixed_float16", None, "keras"),
        ("float32", "mixed_bfloat16", "keras"),  # one mixed layer is enough
    ],
)
def test_auto_without_itex(policy, layer_dtype, expected):
    keras.config.set_dtype_policy(policy)
    model = _model(layer_dtype)
    if policy != "float32":
        # Built under a mixed policy; the global policy alone no longer decides.
        keras.config.set_dtype_policy("float32")
    assert _compat.itex_module() is None
    assert resolve_engine("auto", model).name == expected


def test_auto_picks_a_graph_engine_only_for_op_lists(monkeypatch):
    lists = PrecisionLists(deny_ops=("Softmax",))
    assert resolve_engine("auto", _model(), lists).name == "grappler"
    layer_lists = PrecisionLists(deny_layers=("d1",))
    assert resolve_engine("auto", _model(), layer_lists).name == "keras"
    monkeypatch.setattr(_compat, "itex_module", lambda: object())
    assert resolve_engine("auto", _model(), lists).name == "itex"
    # ITEX being importable is no request for its rewrite.
    assert resolve_engine("auto", _model(), layer_lists).name == "keras"


def test_auto_follows_a_rewrite_the_user_switched_on():
    tf.config.optimizer.set_experimental_options(
        {"auto_mixed_precision_onednn_bfloat16": True}
    )
    assert resolve_engine("auto", _model()).name == "grappler"


def test_itex_auto_mixed_precision_env_asks_for_itex(monkeypatch):
    monkeypatch.setattr(_compat, "itex_module", lambda: object())
    monkeypatch.setenv("ITEX_AUTO_MIXED_PRECISION", "1")
    assert resolve_engine("auto", _model()).name == "itex"
    # A mixed-policy model's precision is decided by its Keras policies: ITEX's
    # op lists cannot put a float16 layer back into float32, the keras engine can.
    keras.config.set_dtype_policy("mixed_bfloat16")
    assert resolve_engine("auto", _model()).name == "keras"


@pytest.mark.parametrize("engine", ["xla", 42, None, ""])
def test_check_engine_name_rejects_what_resolve_would(engine):
    with pytest.raises(ValueError, match="Received: engine="):
        check_engine_name(engine)


def test_engines_share_the_op_type_mapping():
    layer = keras.layers.Conv2D(2, 3)
    for name in ("keras", "grappler", "itex"):
        assert resolve_engine(name, _model()).op_types_for_layer(layer)[0] == "Conv2D"


def test_auto_follows_a_mixed_global_policy_set_after_building():
    model = _model()
    keras.config.set_dtype_policy("mixed_bfloat16")
    assert resolve_engine("auto", model).name == "keras"

import warnings

import keras
import pytest

from keras_amp_plus import _compat
from keras_amp_plus._lists.list_fields import (
    FIELD_NAMES,
    merge_list_fields,
    op_placements,
    without_conflicts,
)
from keras_amp_plus._lists.precision_lists import PrecisionLists
from keras_amp_plus.engines import ItexEngine
from keras_amp_plus.engines._itex import itex_list_fields

DENSE_OP_TYPES = ("MatMul", "BatchMatMulV2", "BiasAdd", "BiasAddGrad")


def _model():
    return keras.Sequential(
        [
            keras.Input((4,)),
            keras.layers.Dense(4, name="d1"),
            keras.layers.LayerNormalization(name="ln"),
            keras.layers.Dense(2, activation="softmax", name="head"),
        ]
    )


@pytest.mark.skipif(
    _compat.itex_module() is not None, reason="covers the stack without ITEX"
)
def test_apply_without_itex_raises_with_the_install_hint():
    with pytest.raises(ImportError) as info:
        ItexEngine().apply(_model(), PrecisionLists(deny_ops=("Mean",)))
    message = str(info.value)
    assert "Intel Extension for TensorFlow" in message
    assert 'pip install "intel-extension-for-tensorflow[cpu]==2.15.0.0"' in message
    assert "engine='grappler'" in message
    assert "Received: engine='itex'" in message
    ItexEngine().restore()  # nothing was applied: nothing to restore


def test_data_type_is_checked():
    with pytest.raises(ValueError, match=r"Received: data_type='bf16'"):
        ItexEngine(data_type="bf16")


@pytest.mark.itex
@pytest.mark.parametrize("float16_arithmetic", [False, True])
def test_float16_on_a_cpu_without_its_arithmetic_fails_before_training(
    monkeypatch, float16_arithmetic
):
    # ITEX's CPU build skips its whole rewrite for FLOAT16 there: the model
    # would train in float32.
    from keras_amp_plus import _hardware

    facts = _hardware.cpu_facts()
    features = {flag: False for flag in _hardware.LOW_PRECISION_FLAGS}
    features["avx512_fp16"] = float16_arithmetic
    monkeypatch.setattr(_hardware, "cpu_facts", lambda: {**facts, "features": features})
    monkeypatch.setattr(_hardware, "has_xpu", lambda: False)
    engine = ItexEngine(data_type="FLOAT16")
    if float16_arithmetic:
        engine.check_available(_model())
        return
    with pytest.raises(RuntimeError, match="cannot run on this CPU") as info:
        engine.check_available(_model())
    assert "data_type='BFLOAT16'" in str(info.value)
    assert "Received: engine='itex', data_type='FLOAT16'" in str(info.value)
    # Called directly, apply refuses too, before ITEX's config changes.
    import intel_extension_for_tensorflow as itex

    before = itex.get_config().SerializeToString(deterministic=True)
    with pytest.raises(RuntimeError, match="cannot run on this CPU"):
        engine.apply(_model(), PrecisionLists())
    assert itex.get_config().SerializeToString(deterministic=True) == before


def test_every_add_is_paired_with_removes_from_the_other_lists():
    fields = itex_list_fields({}, {"Mean": "deny", "MatMul": "infer"}, environ={})
    assert set(fields) == set(FIELD_NAMES)
    assert fields["denylist_add"] == "Mean"
    assert fields["inferlist_add"] == "MatMul"
    for name in ("allow", "infer", "clear"):
        assert "Mean" in fields[f"{name}list_remove"].split(",")
    for name in ("allow", "clear", "deny"):
        assert "MatMul" in fields[f"{name}list_remove"].split(",")
    assert fields["denylist_remove"] == "MatMul"
    assert fields["clearlist_add"] == ""


def test_a_remove_beside_an_add_to_the_same_list_keeps_its_meaning():
    # REMOVE wins over an ADD to the same list: the op type is in no list,
    # and nothing pairs it with REMOVEs from the others.
    fields = without_conflicts({"denylist_add": "Mean", "denylist_remove": "Mean"})
    assert fields["denylist_remove"] == "Mean"
    assert fields["allowlist_remove"] == fields["inferlist_remove"] == ""


def test_the_users_own_matmul_entry_takes_itex_fused_matmuls_along():
    # ITEX fuses most MatMuls: the user's `MatMul` alone left them in bfloat16.
    environ = {"ITEX_AUTO_MIXED_PRECISION_DENYLIST_ADD": "MatMul"}
    fields = itex_list_fields({}, {"Softmax": "deny"}, environ=environ)
    denied = fields["denylist_add"].split(",")
    assert denied[:2] == ["MatMul", "_ITEXFusedMatMul"]
    assert "_ITEXFusedMatMulGrad" in denied and "Softmax" in denied
    assert "_ITEXFusedMatMul" in fields["allowlist_remove"].split(",")
    # The lists' own placement wins over the user's entry and its variants.
    fields = itex_list_fields({}, {"MatMul": "allow"}, environ=environ)
    assert fields["allowlist_add"] == "MatMul"
    assert "MatMul" not in fields["denylist_add"].split(",")


def test_the_users_config_is_the_starting_point():
    current = {
        "denylist_add": "Pow,Softmax",  # kept, Softmax moves away below
        "allowlist_remove": "Softmax,Einsum",  # Softmax must be allowed now
        "inferlist_add": "",
    }
    environ = {
        "ITEX_AUTO_MIXED_PRECISION_INFERLIST_ADD": "Sqrt",  # used: field empty
        "ITEX_AUTO_MIXED_PRECISION_DENYLIST_ADD": "Tanh",  # ignored: field wins
    }
    fields = itex_list_fields(current, {"Softmax": "allow"}, environ=environ)
    assert fields["denylist_add"] == "Pow"
    assert fields["allowlist_add"] == "Softmax"

    # Every op the lists ADD is also REMOVEd from the other lists, the user's
    # own entries included (ITEX's defaults could hold them elsewhere).
    def entries(field):
        return set(fields[field].split(","))

    assert entries("allowlist_remove") == {"Einsum", "Sqrt", "Pow"}
    assert fields["inferlist_add"] == "Sqrt"
    assert entries("denylist_remove") == {"Softmax", "Sqrt"}


def test_denying_a_layer_warns_of_the_other_layers_its_op_types_reach():
    # Built outside: after `set_random_seed`, Keras 2 seeds each new layer
    # by `random.randint(1, 1e9)`, a DeprecationWarning on Python 3.11.
    model = _model()
    with pytest.warns(UserWarning) as record:
        op_placements(model, PrecisionLists(deny_layers=("head",)))
    message = str(record[0].message)
    dense_ops = "MatMul, BatchMatMulV2, BiasAdd, BiasAddGrad"
    assert f"run these ops in float32 too: d1 ({dense_ops})." in message
    assert "engine='keras'" in message
    assert "deny_ops=('BatchMatMulV2', 'BiasAdd', 'BiasAddGrad', 'MatMul')" in message
    assert "Received: deny_layers=('head',)" in message


@pytest.mark.parametrize(
    "lists",
    [
        # The layer norm's op types run no other layer.
        PrecisionLists(deny_layers=("ln",)),
        # The shared op types placed outright: the user's own choice.
        PrecisionLists(deny_layers=("head",), allow_ops=DENSE_OP_TYPES),
        PrecisionLists(deny_layers=("head",), deny_ops=DENSE_OP_TYPES),
    ],
    ids=["unshared", "allowed_outright", "denied_outright"],
)
def test_denying_a_layer_warns_of_nothing_else_when_nothing_else_is_denied(lists):
    model = _model()  # outside, as above
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        op_placements(model, lists)


def test_merge_rejects_an_unknown_list():
    with pytest.raises(ValueError, match=r"Received: MatMul='float32'"):
        merge_list_fields({}, {"MatMul": "float32"})


def test_layer_entries_become_op_types_and_explicit_ops_win():
    lists = PrecisionLists(
        allow_layers=("d1",), deny_layers=("ln", "head"), allow_ops=("Softmax",)
    )
    with pytest.warns(UserWarning, match=r"in float32 too: d1 \(MatMul, "):
        placements = op_placements(_model(), lists)
    # d1 allows MatMul but head (also a Dense) denies it: deny wins.
    assert placements["MatMul"] == "deny"
    assert placements["Mean"] == placements["Rsqrt"] == "deny"
    assert placements["Softmax"] == "allow"  # the explicit op entry


@pytest.mark.itex
def test_the_grappler_engine_is_refused_where_itex_would_crash_on_its_rewrite():
    # ITEX's remapper segfaults on a train step grappler's bfloat16 rewrite
    # converted: refused before anything changes, the ITEX engine named.
    import numpy as np

    import keras_amp_plus as kap
    from keras_amp_plus.engines import GrapplerEngine

    model = _model()
    model.compile("sgd", "mse")
    with pytest.raises(RuntimeError, match="engine='itex'"):
        GrapplerEngine().check_available(model)
    x, y = np.ones((8, 4), "float32"), np.ones((8, 2), "float32")
    monitor = kap.callbacks.AMPMonitor(None, engine="grappler")
    with pytest.raises(RuntimeError, match="segmentation fault"):
        model.fit(x, y, verbose=0, callbacks=[monitor])
    assert int(model.optimizer.iterations.numpy()) == 0

import dataclasses
import json

import keras
import pytest
from conftest import nested_model

from keras_amp_plus._lists.op_types import (
    ACTIVATION_OP_TYPES,
    LAYER_OP_TYPES,
    known_op_types,
    op_types_for_layer,
)
from keras_amp_plus._lists.precision_lists import PrecisionLists

FULL = PrecisionLists(
    allow_layers=("dense.*",),
    deny_layers=("LayerNormalization", "encoder/ln_1"),
    allow_ops=("MatMul",),
    infer_ops=("Mean",),
    clear_ops=("Reshape",),
    deny_ops=("Softmax", "Exp"),
)


def test_lists_are_immutable_values():
    lists = PrecisionLists(deny_ops=["Softmax"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        lists.deny_ops = ("MatMul",)
    assert lists.deny_ops == ("Softmax",)
    assert lists == PrecisionLists(deny_ops=("Softmax",))
    assert hash(lists) == hash(PrecisionLists(deny_ops=("Softmax",)))
    # A layer or op type is in a list or not: the order decides nothing.
    assert PrecisionLists(deny_ops=("Exp", "Log")) == PrecisionLists(
        deny_ops=("Log", "Exp")
    )
    variants = {PrecisionLists(deny_ops=("Exp", "Log")), FULL.replace(deny_ops=())}
    assert len(variants | {PrecisionLists(deny_ops=("Log", "Exp"))}) == 2
    assert PrecisionLists(deny_ops=("Exp",)) != PrecisionLists(allow_ops=("Exp",))
    assert PrecisionLists() != {}


def test_inputs_are_normalized():
    lists = PrecisionLists(deny_ops="Softmax", allow_layers=[" a ", "b", "a"])
    assert lists.deny_ops == ("Softmax",)
    assert lists.allow_layers == ("a", "b")


def test_move_layers_returns_new_lists_and_leaves_the_old_one():
    before = PrecisionLists(allow_layers=("a", "b"), deny_layers=("c",))
    after = before.move_layers(["a", "c"], to="deny")
    assert before.allow_layers == ("a", "b") and before.deny_layers == ("c",)
    assert after.allow_layers == ("b",)
    assert after.deny_layers == ("a", "c")
    back = after.move_layers("a", to="allow")
    assert back.allow_layers == ("b", "a") and back.deny_layers == ("c",)


def test_move_ops_leaves_every_other_op_list():
    after = FULL.move_ops(["Mean", "Softmax"], to="clear")
    assert after.infer_ops == ()
    assert after.deny_ops == ("Exp",)
    assert after.clear_ops == ("Reshape", "Mean", "Softmax")
    assert after.op_list_of("Mean") == "clear"
    assert FULL.op_list_of("Mean") == "infer"


@pytest.mark.parametrize(
    ("method", "to", "expected"),
    [("move_layers", "infer", "['allow', 'deny']"), ("move_ops", "float32", "clear")],
)
def test_move_to_an_unknown_list_is_rejected(method, to, expected):
    with pytest.raises(ValueError, match=rf"Received: to='{to}'") as info:
        getattr(FULL, method)(["x"], to=to)
    assert expected in str(info.value)


def test_replace_validates_like_the_constructor():
    assert FULL.replace(deny_ops=("Pow",)).deny_ops == ("Pow",)
    with pytest.raises(ValueError, match="in both `allow_ops` and `deny_ops`"):
        FULL.replace(deny_ops=("MatMul",))


def test_replace_and_moves_name_bad_arguments():
    with pytest.raises(TypeError, match=r"Unknown `PrecisionLists` fields \['deny'\]"):
        FULL.replace(deny=("MatMul",))
    with pytest.raises(TypeError, match=r"Received: op_types=5"):
        FULL.move_ops(5, to="deny")
    with pytest.raises(ValueError, match=r"'Matmul'.*Did you mean MatMul"):
        FULL.move_ops("Matmul", to="deny")


def test_config_and_json_round_trip():
    config = FULL.get_config()
    assert config["deny_layers"] == ["LayerNormalization", "encoder/ln_1"]
    assert PrecisionLists.from_config(config) == FULL
    text = FULL.to_json()
    assert json.loads(text) == config
    assert PrecisionLists.from_json(text) == FULL
    assert PrecisionLists.from_json(PrecisionLists().to_json()) == PrecisionLists()


@pytest.mark.parametrize(
    "config", [[("deny_layers", ["head"])], "deny_layers", None], ids=str
)
def test_from_config_takes_a_dict_only(config):
    with pytest.raises(TypeError, match=r"takes a dict.*Received: config="):
        PrecisionLists.from_config(config)


def test_a_field_given_a_dict_is_refused():
    with pytest.raises(TypeError, match=r"`deny_layers` must be a tuple of strings"):
        PrecisionLists.from_config({"deny_layers": {"head": 1}})


def test_from_config_rejects_unknown_keys():
    with pytest.raises(ValueError, match=r"Unknown `PrecisionLists` config keys"):
        PrecisionLists.from_config({"deny": ["MatMul"]})


def test_from_env_reads_tf_and_itex_variables(monkeypatch):
    monkeypatch.setenv(
        "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_DENYLIST_ADD", "Mean, Rsqrt"
    )
    monkeypatch.setenv("TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_ALLOWLIST_ADD", "Einsum")
    # A move (REMOVE from allow, ADD to deny) is said by the ADD: no warning.
    monkeypatch.setenv(
        "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_ALLOWLIST_REMOVE", "Rsqrt"
    )
    monkeypatch.setenv("ITEX_AUTO_MIXED_PRECISION_DENYLIST_ADD", "Softmax,Mean")
    monkeypatch.setenv("ITEX_AUTO_MIXED_PRECISION_CLEARLIST_ADD", "Reshape")
    monkeypatch.delenv("ITEX_AUTO_MIXED_PRECISION_INFERLIST_ADD", raising=False)
    monkeypatch.delenv(
        "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_INFERLIST_ADD", raising=False
    )
    lists = PrecisionLists.from_env()
    assert lists.deny_ops == ("Mean", "Rsqrt", "Softmax")
    assert lists.allow_ops == ("Einsum",)
    assert lists.clear_ops == ("Reshape",)
    assert lists.infer_ops == ()
    assert lists.allow_layers == lists.deny_layers == ()


def test_from_env_warns_about_removes_it_cannot_hold():
    environ = {
        # Tanh leaves INFER for no list: PrecisionLists has no such entry.
        "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_INFERLIST_REMOVE": "Mean,Tanh",
        "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_DENYLIST_ADD": "Mean",
        # ADD and REMOVE on the same list: the REMOVE wins, as in TF and ITEX.
        "ITEX_AUTO_MIXED_PRECISION_CLEARLIST_ADD": "Reshape,Softmax",
        "ITEX_AUTO_MIXED_PRECISION_CLEARLIST_REMOVE": "Softmax",
    }
    with pytest.warns(UserWarning, match=r"no 'in no list' entry") as record:
        lists = PrecisionLists.from_env(environ)
    assert lists.deny_ops == ("Mean",)
    assert lists.clear_ops == ("Reshape",)
    assert lists.infer_ops == ()
    message = str(record[0].message)
    assert (
        "Received: {'TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_INFERLIST_REMOVE': "
        "['Tanh'], 'ITEX_AUTO_MIXED_PRECISION_CLEARLIST_REMOVE': ['Softmax']}"
    ) in message


def test_from_env_with_an_explicit_mapping_and_a_conflict():
    assert PrecisionLists.from_env({}) == PrecisionLists()
    environ = {
        "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_ALLOWLIST_ADD": "MatMul",
        "ITEX_AUTO_MIXED_PRECISION_DENYLIST_ADD": "MatMul",
    }
    with pytest.raises(ValueError) as info:
        PrecisionLists.from_env(environ)
    message = str(info.value)
    assert "'MatMul' is in both `allow_ops` and `deny_ops`" in message
    assert "'ITEX_AUTO_MIXED_PRECISION_DENYLIST_ADD': 'MatMul'" in message
    assert "'TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_ALLOWLIST_ADD': 'MatMul'" in message


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"allow_layers": ("dense",), "deny_layers": ("dense",)},
            r"'dense' is in both `allow_layers` and `deny_layers`.*"
            r"Received: allow_layers=\('dense',\), deny_layers=\('dense',\)",
        ),
        (
            {"infer_ops": ("Mean",), "deny_ops": ("Rsqrt", "Mean")},
            r"'Mean' is in both `infer_ops` and `deny_ops`.*move_ops",
        ),
        (
            {"deny_layers": ("block_[0-9",)},
            r"`deny_layers` entry 'block_\[0-9' is not a valid regular expression"
            r".*re\.escape.*Received: deny_layers=\('block_\[0-9',\)",
        ),
        (
            {"deny_ops": ("Matmul",)},
            r"'Matmul', which is not a TensorFlow op type.*Did you mean MatMul"
            r".*Received: deny_ops=\('Matmul',\)",
        ),
        (
            {"allow_ops": ("Sofmax",)},
            r"Did you mean Softmax",
        ),
    ],
)
def test_bad_input_raises_value_error_naming_it(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PrecisionLists(**kwargs)


@pytest.mark.parametrize("value", [("ok", 3), ("",), 5])
def test_non_string_entries_raise_type_error(value):
    with pytest.raises(TypeError, match=r"Received: deny_layers="):
        PrecisionLists(deny_layers=value)


def test_diff_lists_every_move():
    after = FULL.move_layers(["dense.*"], to="deny").move_ops(["Exp"], to="allow")
    after = after.replace(clear_ops=())
    assert FULL.diff(after) == [
        {"kind": "layer", "name": "dense.*", "from": "allow", "to": "deny"},
        {"kind": "op", "name": "Exp", "from": "deny", "to": "allow"},
        {"kind": "op", "name": "Reshape", "from": "clear", "to": None},
    ]
    assert FULL.diff(FULL) == []


def test_to_markdown_has_one_row_per_list():
    text = FULL.to_markdown()
    lines = text.splitlines()
    assert lines[0] == "| list | entries |"
    assert "| deny_layers | `LayerNormalization`, `encoder/ln_1` |" in lines
    assert "| infer_ops | `Mean` |" in lines
    assert "| allow_ops | `MatMul` |" in lines
    assert len(lines) == 2 + 6
    assert "| clear_ops | - |" in PrecisionLists().to_markdown()
    # A regex alternation must not end the table cell.
    row = PrecisionLists(deny_layers=("d1|d2",)).to_markdown().splitlines()[3]
    assert row == r"| deny_layers | `d1\|d2` |"
    # Nor a backtick end the code span (CommonMark: a longer fence).
    row = PrecisionLists(deny_layers=("a`b",)).to_markdown().splitlines()[3]
    assert row == "| deny_layers | `` a`b `` |"


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ("d1", ["d1"]),
        ("inner/ln", ["ln"]),
        ("Dense", ["d1", "a", "head"]),
        ("inner/.*", ["ln", "a"]),
        ("inner", ["inner"]),
    ],
)
def test_matching_layers_by_name_path_class_and_regex(entry, expected):
    matches = PrecisionLists(deny_layers=(entry,)).matching_layers(nested_model())
    assert sorted(layer.name for layer in matches[entry]) == sorted(expected)


def test_an_entry_matching_no_layer_suggests_close_names():
    lists = PrecisionLists(allow_layers=("d1",), deny_layers=("inner/lnn",))
    with pytest.raises(ValueError) as info:
        lists.matching_layers(nested_model())
    message = str(info.value)
    assert "'inner/lnn' matches no layer of model 'outer'" in message
    assert "Did you mean inner/ln" in message
    assert "Received: deny_layers=('inner/lnn',)" in message


def test_every_mapped_op_type_is_known_to_tensorflow():
    mapped = {op for ops in LAYER_OP_TYPES.values() for op in ops}
    mapped |= {op for ops in ACTIVATION_OP_TYPES.values() for op in ops}
    assert mapped <= known_op_types()
    assert {"MatMul", "Conv2D", "Softmax", "_FusedBatchNormEx"} <= known_op_types()


def test_op_types_for_layers_classes_activations_and_containers():
    assert op_types_for_layer(keras.layers.Dense(2, activation="softmax")) == (
        "MatMul",
        "BatchMatMulV2",
        "BiasAdd",
        "BiasAddGrad",
        "Softmax",
    )
    assert "Conv2DBackpropFilter" in op_types_for_layer(keras.layers.Conv2D(2, 3))
    assert op_types_for_layer(keras.layers.LayerNormalization())[:3] == (
        "Mean",
        "SquaredDifference",
        "Rsqrt",
    )
    assert op_types_for_layer(keras.layers.Flatten()) == ()

    class MyDense(keras.layers.Dense):
        pass

    assert op_types_for_layer(MyDense(2))[0] == "MatMul"
    nested = op_types_for_layer(nested_model().get_layer("inner"))
    assert {"MatMul", "Mean", "Rsqrt"} <= set(nested)
    assert len(nested) == len(set(nested))

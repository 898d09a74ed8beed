"""Layer configs saved on one stack load on the other.

`tests/data/stack_configs_keras3.json` was written by Keras 3.15 and
`stack_configs_keras2.json` by Keras 2.15 (`tests/data/make_stack_configs.py`).
Each stack loads the other's file into layers equal to the ones it loads from
its own file.
"""

import json
import os

import keras
import pytest

import keras_amp_plus as kap
from keras_amp_plus import _compat

DATA = os.path.join(os.path.dirname(__file__), "data")
THIS_STACK = "keras3" if _compat.IS_KERAS_3 else "keras2"
OTHER_STACK = "keras2" if _compat.IS_KERAS_3 else "keras3"
NAMES = ("InstanceNormalization", "LayerNormalization", "Swish")


def saved_configs(stack):
    with open(os.path.join(DATA, f"stack_configs_{stack}.json")) as f:
        return json.load(f)["configs"]


@pytest.mark.parametrize("name", NAMES)
def test_the_other_stacks_config_loads_as_this_stacks_own(name):
    theirs = keras.layers.deserialize(saved_configs(OTHER_STACK)[name])
    ours = keras.layers.deserialize(saved_configs(THIS_STACK)[name])
    assert type(theirs) is getattr(kap.layers, name)
    assert theirs.get_config() == ours.get_config()
    assert theirs.dtype_policy.name == ours.dtype_policy.name


def test_policies_and_arguments_survive_the_trip():
    configs = saved_configs(OTHER_STACK)
    layer_norm = keras.layers.deserialize(configs["LayerNormalization"])
    assert layer_norm.dtype_policy.name == "mixed_bfloat16"
    assert layer_norm.epsilon == 1e-4 and layer_norm.center is False
    instance_norm = keras.layers.deserialize(configs["InstanceNormalization"])
    assert instance_norm.dtype_policy.name == "mixed_float16"
    swish = keras.layers.deserialize(configs["Swish"])
    assert swish.initial_beta == 0.5 and swish.trainable_beta


@pytest.mark.skipif(_compat.IS_KERAS_3, reason="Keras 3 has rms_scaling")
def test_a_keras3_only_argument_raises_a_clear_error_on_keras2():
    config = json.loads(json.dumps(saved_configs("keras3")["LayerNormalization"]))
    config["config"]["rms_scaling"] = True
    with pytest.raises(ValueError, match="Received: rms_scaling=True"):
        keras.layers.deserialize(config)

"""Bad arguments raise ValueError/TypeError naming the received value."""

import re

import keras
import pytest

from keras_amp_plus.optimizers import LossScaleOptimizer


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"min_scale": 0.0, "initial_scale": 1.0}, "min_scale=0.0"),
        ({"min_scale": -1.0, "initial_scale": 1.0}, "min_scale=-1.0"),
        ({"min_scale": 8.0, "max_scale": 4.0, "initial_scale": 4.0}, "max_scale=4.0"),
        ({"backoff_factor": 0.0}, "backoff_factor=0.0"),
        ({"backoff_factor": 1.0}, "backoff_factor=1.0"),
        ({"backoff_factor": 1.5}, "backoff_factor=1.5"),
        ({"growth_factor": 0.5}, "growth_factor=0.5"),
        ({"hysteresis": 0}, "hysteresis=0"),
        ({"hysteresis": 1.5}, "hysteresis=1.5"),
        ({"dynamic_growth_steps": 0}, "dynamic_growth_steps=0"),
        ({"on_min_scale": "stop"}, "on_min_scale='stop'"),
        ({"initial_scale": 0.5}, "initial_scale=0.5"),
        ({"initial_scale": 2.0**30}, "initial_scale=1073741824.0"),
        ({"initial_scale": float("nan")}, "initial_scale=nan"),
        ({"event_buffer_size": 0}, "event_buffer_size=0"),
        ({"event_buffer_size": 10**9}, "event_buffer_size=1000000000"),
        # float32 rounds these to 0 and to inf: every gradient 0/0, no ceiling.
        ({"min_scale": 1e-50, "initial_scale": 1.0}, "min_scale=1e-50"),
        ({"max_scale": 1e39}, "max_scale=1e\\+39"),
        ({"initial_scale": 1e39, "max_scale": 1e40}, "initial_scale=1e\\+39"),
    ],
)
def test_bad_numbers_raise_value_error_naming_the_value(kwargs, message):
    inner = keras.optimizers.SGD()
    with pytest.raises(ValueError, match="Received: .*" + message.replace("*", r"\*")):
        LossScaleOptimizer(inner, **kwargs)
    assert inner.loss_scale_factor is None  # nothing was changed


@pytest.mark.parametrize(
    "kwargs",
    [
        {"initial_scale": "1"},
        {"min_scale": None},
        {"growth_factor": True},
        {"hysteresis": "2"},
        {"event_buffer_size": [64]},
    ],
)
def test_arguments_that_are_no_numbers_raise_type_error(kwargs):
    [(name, value)] = kwargs.items()
    expected = re.escape(f"Received: {name}={value!r} of type")
    with pytest.raises(TypeError, match=expected):
        LossScaleOptimizer(keras.optimizers.SGD(), **kwargs)


def test_a_scale_outside_float32_names_an_example_of_itself():
    with pytest.raises(ValueError, match=r"Use e\.g\. `initial_scale=2\.0\*\*15`"):
        LossScaleOptimizer(keras.optimizers.SGD(), initial_scale=0.0)


@pytest.mark.parametrize("inner", ["adam", None, keras.layers.Dense(1)])
def test_inner_that_is_not_a_keras_optimizer_raises_type_error(inner):
    with pytest.raises(TypeError, match="Received: inner_optimizer="):
        LossScaleOptimizer(inner)


def test_wrapping_a_scaler_raises_type_error():
    scaler = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD())
    with pytest.raises(TypeError, match="already a LossScaleOptimizer"):
        LossScaleOptimizer(scaler)

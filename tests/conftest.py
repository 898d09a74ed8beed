"""Shared fixtures: every test leaves global state as it found it."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import pytest
import tensorflow as tf

from keras_amp_plus import _compat
from keras_amp_plus.engines.grappler import GRAPPLER_OPTION, TOUCHED_VARIABLES

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")


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
    environment = {name: os.environ.get(name) for name in TOUCHED_VARIABLES}
    options = tf.config.optimizer.get_experimental_options()
    yield
    for name, value in environment.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    if GRAPPLER_OPTION in options:
        tf.config.optimizer.set_experimental_options(
            {GRAPPLER_OPTION: options[GRAPPLER_OPTION]}
        )
    else:
        _compat.reset_grappler_option(GRAPPLER_OPTION)

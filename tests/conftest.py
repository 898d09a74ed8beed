"""Shared fixtures: every test leaves global state as it found it."""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import pytest

from keras_amp_plus.engines.grappler import (
    capture_global_state,
    put_back_global_state,
)

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
    state = capture_global_state()
    yield
    put_back_global_state(*state)

"""Shared fixtures: every test leaves global state as it found it.

Stack markers: `keras3` tests need Keras 3 (stock TensorFlow >= 2.16); `itex`
tests need the ITEX stack (TensorFlow 2.15 + Keras 2.15 + Intel Extension for
TensorFlow); `itex_bfloat16` tests also need ITEX's bfloat16 kernels, which a
subprocess probe checks (on CPUs without AVX512 the first bfloat16 MatMul
aborts the process). Each is skipped elsewhere with the reason.
"""

import os

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import keras
import pytest

from keras_amp_plus import _compat
from keras_amp_plus.engines.grappler import (
    capture_global_state,
    put_back_global_state,
)

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")


# The lean suite of the ITEX stack (`make test-itex`): the stack-specific tests
# plus the layer / scaler / monitor core, written against `_compat`. The other
# modules use Keras 3 APIs directly (`keras.config`, `keras.ops`, layer paths,
# Keras 3's scaler attributes) and are skipped on Keras 2 with that reason.
KERAS2_MODULES = (
    "test_engines_itex.py",
    "test_itex_amp.py",
    "test_itex_configs.py",
    "test_itex_layers.py",
    "test_itex_loss_scale.py",
    "test_itex_probe.py",
)


def pytest_collection_modifyitems(config, items):
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
                from keras_amp_plus import itex_probe

                status = itex_probe.itex_bfloat16_status()
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
    keras.backend.clear_session()


@pytest.fixture(autouse=True)
def restore_grappler_state():
    """Grappler options and list variables are process-global: put them back."""
    state = capture_global_state()
    yield
    put_back_global_state(*state)


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

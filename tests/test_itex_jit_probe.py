"""The doctor's `jit_compile` probe runs on both stacks."""

import numpy as np

from keras_amp_plus import _compat
from keras_amp_plus.cli import _jit_probe


def test_the_probe_times_both_steps_and_restores_the_policy():
    # On Keras 2 its model raised while being built under mixed_bfloat16
    # (tf.keras does not promote `+` of float32 and bfloat16), and the whole
    # doctor exited with a traceback.
    before = _compat.global_policy().name
    result = _jit_probe.probe_jit_speedup(seconds=0.2, policy="mixed_bfloat16")
    assert "error" not in result, result
    assert result["graph_ms"] > 0 and result["jit_ms"] > 0
    assert np.isclose(result["speedup"], result["graph_ms"] / result["jit_ms"])
    assert result["rounds"] >= _jit_probe.MIN_ROUNDS
    assert _compat.global_policy().name == before

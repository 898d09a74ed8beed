"""The normalization layers pick their implementation per shape and context.

Both implementations (fused XLA kernels, Keras's formula) must match float64
references with float32 statistics, in graph steps and inside XLA-compiled
steps; the choice must follow the rules in `_path_choice`.
"""

import numpy as np
import pytest
import tensorflow as tf
from test_layers_numerics import _check_normalization, _policy

from keras_amp_plus import layers
from keras_amp_plus.layers import _path_choice

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")


class _StepWrapped:
    """The layer, called inside a tf.function (graph or XLA-compiled) step."""

    def __init__(self, layer, jit_compile):
        self.inner = layer
        self.call_in_step = tf.function(lambda x: layer(x), jit_compile=jit_compile)

    def __getattr__(self, name):  # build, weights, gamma, beta, epsilon
        return getattr(self.inner, name)

    def __call__(self, x):
        return self.call_in_step(x)


# Inputs far from zero: the kernels subtract the mean first and pass on
# N(1000, 1); Keras's formula cancels `x * inv` against `mean * inv` there (as
# Keras's own layers do), so it is held to the same tolerance on N(100, 1).
_FAR_MEAN = {_path_choice.FUSED_KERNELS: 1000.0, _path_choice.KERAS_FORMULA: 100.0}


@pytest.mark.parametrize("jit_compile", (False, True))
@pytest.mark.parametrize(
    "path", (_path_choice.FUSED_KERNELS, _path_choice.KERAS_FORMULA)
)
@pytest.mark.parametrize("policy_name", POLICIES)
def test_each_path_matches_float64_in_graph_and_xla(
    policy_name, path, jit_compile, monkeypatch
):
    monkeypatch.setenv(_path_choice.PATH_VARIABLE, path)
    policy = _policy(policy_name)
    for mean in (0.0, _FAR_MEAN[path]):
        ln = _StepWrapped(layers.LayerNormalization(), jit_compile)
        _check_normalization(ln, (16, 64), mean, policy, (1,), (1, 64))
        inorm = _StepWrapped(layers.InstanceNormalization(), jit_compile)
        shape, params = (4, 8, 8, 16), (1, 1, 1, 16)
        _check_normalization(inorm, shape, mean, policy, (1, 2), params)


def _path_taken(jit_compile, elements_threshold, monkeypatch, trailing=True):
    """Return the path `normalization_path` picks for a (8, 16) input."""
    monkeypatch.setattr(_path_choice, "DOT_SUM_MIN_ELEMENTS", elements_threshold)
    taken = []

    @tf.function(jit_compile=jit_compile)
    def step(x):
        elements = x.shape.num_elements()
        taken.append(_path_choice.normalization_path(elements, trailing))
        return x

    step(tf.zeros([8, 16]))
    return taken[0]


def test_inside_xla_keras_formula_below_dot_size(monkeypatch):
    monkeypatch.delenv(_path_choice.PATH_VARIABLE, raising=False)
    assert _path_taken(True, 1000, monkeypatch) == _path_choice.KERAS_FORMULA
    assert _path_taken(True, 128, monkeypatch) == _path_choice.FUSED_KERNELS


def test_graph_step_path_follows_cpu_features_and_axes(monkeypatch):
    monkeypatch.delenv(_path_choice.PATH_VARIABLE, raising=False)
    kernels, formula = _path_choice.FUSED_KERNELS, _path_choice.KERAS_FORMULA
    for has_avx512, trailing, expected in (
        (True, True, kernels),
        (True, False, formula),
        (False, True, formula),
        (False, False, formula),
    ):
        monkeypatch.setattr(_path_choice, "cpu_has_avx512", lambda v=has_avx512: v)
        assert _path_taken(False, 1000, monkeypatch, trailing) == expected
        # Large inputs: the kernels on every CPU.
        assert _path_taken(False, 128, monkeypatch, trailing) == kernels


def test_graph_rewrite_keeps_the_kernels(monkeypatch):
    # The rewrite would paint the formula's statistics bfloat16.
    monkeypatch.delenv(_path_choice.PATH_VARIABLE, raising=False)
    monkeypatch.setattr(_path_choice, "cpu_has_avx512", lambda: False)
    monkeypatch.setattr(_path_choice, "graph_rewrite_on", lambda: True)
    for trailing in (True, False):
        taken = _path_taken(False, 1000, monkeypatch, trailing)
        assert taken == _path_choice.FUSED_KERNELS


def test_unknown_path_variable_raises(monkeypatch):
    monkeypatch.setenv(_path_choice.PATH_VARIABLE, "fastest")
    with pytest.raises(ValueError, match="Received: KERAS_AMP_PLUS"):
        layers.LayerNormalization()(np.zeros((2, 3), "float32"))

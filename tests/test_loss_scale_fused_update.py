"""The inner optimizer's update, compiled with XLA inside a graph step.

Checked against a float64 NumPy Adam, and where it runs: in XLA inside a
`tf.function` step for variables of at least `MIN_ELEMENTS` elements, as
Keras's own code eagerly or for smaller variables, and never nested in an
XLA-compiled step (XLA compiles the whole step there).
"""

import keras
import numpy as np
import pytest
import tensorflow as tf

from keras_amp_plus import _compat
from keras_amp_plus.optimizers import LossScaleOptimizer
from keras_amp_plus.optimizers._compiled_update import MIN_ELEMENTS

pytestmark = pytest.mark.keras3


def numpy_adam(weights, grads, learning_rate, beta_1=0.9, beta_2=0.999, eps=1e-7):
    """Keras's Adam in float64 (epsilon added to the bias-corrected sqrt(v))."""
    weights = weights.astype(np.float64)
    m = np.zeros_like(weights)
    v = np.zeros_like(weights)
    for step, grad in enumerate(grads, start=1):
        m = beta_1 * m + (1 - beta_1) * grad
        v = beta_2 * v + (1 - beta_2) * grad**2
        alpha = learning_rate * np.sqrt(1 - beta_2**step) / (1 - beta_1**step)
        weights = weights - alpha * m / (np.sqrt(v) + eps)
    return weights


@pytest.mark.parametrize("mode", ["eager", "graph", "xla"])
@pytest.mark.parametrize("large", [True, False])
def test_updates_match_float64_adam_and_run_fused_in_graph_steps(
    mode, large, monkeypatch
):
    traced_in_xla = []
    update_step = keras.optimizers.Adam.update_step

    def observed_update_step(self, *args, **kwargs):
        traced_in_xla.append(_compat.in_xla_compiled_function())
        return update_step(self, *args, **kwargs)

    monkeypatch.setattr(keras.optimizers.Adam, "update_step", observed_update_step)
    rng = np.random.default_rng(0)
    shape = (MIN_ELEMENTS // 64, 64) if large else (3, 4)
    start = rng.normal(size=shape).astype("float32")
    grads = [rng.normal(size=shape).astype("float32") for _ in range(5)]
    variable = keras.Variable(start)
    optimizer = LossScaleOptimizer.guard(keras.optimizers.Adam(0.01))
    optimizer.build([variable])

    def step(grad):
        optimizer.apply([grad], [variable])

    if mode != "eager":
        step = tf.function(step, jit_compile=mode == "xla")
    for grad in grads:
        step(tf.constant(grad))
    expected = numpy_adam(start, grads, 0.01)
    # Float32 rounding of weights of order 1 over 5 updates of order 0.01.
    np.testing.assert_allclose(variable.numpy(), expected, rtol=1e-5, atol=1e-6)
    # Graph step: a nested XLA function for a large variable; an XLA step
    # compiles it whole anyway.
    expect_xla = mode == "xla" or (mode == "graph" and large)
    assert traced_in_xla and all(traced_in_xla) == expect_xla

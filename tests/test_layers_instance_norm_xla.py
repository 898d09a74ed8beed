"""InstanceNormalization inside a model XLA compiles whole: layout and numerics."""

import keras
import pytest
import tensorflow as tf
from conftest import (
    check_normalization,
    float_inputs,
    hlo_without_names,
    use_policy,
    xla_step,
)

from keras_amp_plus import layers

SHAPE = (4, 8, 8, 16)


def _optimized_hlo(layer, dtype, any_batch):
    x, upstream, _, _ = float_inputs(SHAPE, 0.0, dtype)
    signature = None
    if any_batch:  # as `fit` traces a `tf.data` pipeline without drop_remainder
        spec = tf.TensorSpec((None, *SHAPE[1:]), dtype)
        signature = [spec, spec]
    step = xla_step(layer, SHAPE, signature)
    return step.experimental_get_compiler_ir(x, upstream)("optimized_hlo")


@pytest.mark.parametrize("any_batch", (False, True))
def test_float16_inside_xla_runs_keras_own_program(any_batch):
    # The plain layout compiled to a program up to 1.4x slower than Keras's
    # layer in float16; Keras's (..., channels, 1) layout compiles to Keras's.
    use_policy("mixed_float16")
    ours = _optimized_hlo(layers.InstanceNormalization(), "float16", any_batch)
    keras_own = _optimized_hlo(
        keras.layers.GroupNormalization(groups=-1), "float16", any_batch
    )
    assert hlo_without_names(ours) == hlo_without_names(keras_own)


@pytest.mark.parametrize("policy_name", ("float32", "mixed_bfloat16"))
def test_float32_and_bfloat16_inside_xla_keep_the_plain_layout(policy_name):
    # There the plain layout ran as fast (bfloat16) or 10-23% faster (float32).
    compute = use_policy(policy_name).compute_dtype
    hlo = _optimized_hlo(layers.InstanceNormalization(), compute, any_batch=False)
    assert "f32[4,8,8,16]" in hlo
    assert "f32[4,8,8,16,1]" not in hlo


class _InXlaStep:
    """The layer called inside a `jit_compile=True` function, as a model calls it."""

    def __init__(self, layer, any_batch):
        self.inner = layer
        signature = None
        if any_batch:
            signature = [tf.TensorSpec((None, *SHAPE[1:]), layer.compute_dtype)]
        self.call_in_step = tf.function(
            lambda x: layer(x), jit_compile=True, input_signature=signature
        )

    def __getattr__(self, name):  # build, weights, gamma, beta, epsilon
        return getattr(self.inner, name)

    def __call__(self, x):
        return self.call_in_step(x)


@pytest.mark.parametrize("any_batch", (False, True))
@pytest.mark.parametrize("mean", (0.0, 100.0))
def test_float16_inside_xla_matches_float64(mean, any_batch):
    policy = use_policy("mixed_float16")
    layer = _InXlaStep(layers.InstanceNormalization(), any_batch)
    check_normalization(layer, SHAPE, mean, policy, (1, 2), (1, 1, 1, 16))

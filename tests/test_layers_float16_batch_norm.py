"""float16 instance norms in graph steps, widened or not.

On a CPU without float16 arithmetic TensorFlow's batch-norm kernel and the
fused XLA kernels run in float32 (the input widened, the result rounded
once); with it, in float16. Either way the results must match float64
references, for each form the kernels take: TensorFlow's kernel on the whole
batch transposed (its own gradient, and the explicit backward the run-time
switch runs) and per sample (unrolled, and in a loop for any batch size);
the XLA kernels as one path and behind the run-time switch.
"""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf
from conftest import check_normalization, use_policy

from keras_amp_plus import layers
from keras_amp_plus.layers import (
    _batch_norm_formula,
    _fused_normalization,
    _path_choice,
    _per_sample_batch_norm,
    _precision,
    _saved_gradient,
)

pytestmark = pytest.mark.usefixtures("empty_path_cache")

SHAPE, STAT_AXES, PARAMS = (4, 8, 8, 16), (1, 2), (1, 1, 1, 16)
KERNEL_OPS = ("FusedBatchNormV3", "FusedBatchNormGradV3")
# The XLA kernels' functions and the position of `x` among their arguments.
XLA_KERNELS = {"_normalize_forward": 0, "_normalize_backward": 1}
CALL_OPS = ("PartitionedCall", "StatefulPartitionedCall")


class _Step:
    """An instance norm of `layer`'s weights in a graph step, gradient included.

    `normalize(x, gamma, beta, epsilon, stat_axes, dtype)` is the form under
    test; `any_batch` traces the step for any batch size.
    """

    def __init__(self, layer, normalize, any_batch=False):
        self.inner = layer
        batch = None if any_batch else SHAPE[0]
        self.spec = tf.TensorSpec((batch, *SHAPE[1:]), tf.float16)

        @tf.function(input_signature=[self.spec])
        def call(x):
            gamma, beta = _precision.broadcast_weights(
                layer.gamma, layer.beta, x, (x.shape.rank - 1,)
            )
            return normalize(x, gamma, beta, layer.epsilon, STAT_AXES, tf.float16)

        self.call_in_step = call

    def __getattr__(self, name):  # build, weights, gamma, beta, epsilon
        return getattr(self.inner, name)

    def __call__(self, x):
        return self.call_in_step(x)

    def kernel_dtypes(self):
        """Return the dtypes the kernels read `x` in, forward and backward.

        TensorFlow's batch-norm kernel by its `T`; the XLA kernels by the
        dtype their call passes for `x` (`_normalize_forward`'s first
        argument, `_normalize_backward`'s second).
        """

        @tf.function(input_signature=[self.spec, self.spec])
        def step(x, upstream):
            with tf.GradientTape() as tape:
                tape.watch(x)
                outputs = self(x)
            return tape.gradient(outputs, x, output_gradients=upstream)

        graph = step.get_concrete_function().graph
        library = graph.as_graph_def().library.function
        nodes = [op.node_def for op in graph.get_operations()]
        nodes += [node for function in library for node in function.node_def]
        read = {}
        for node in nodes:
            if node.op in KERNEL_OPS:
                read[node.op] = tf.as_dtype(node.attr["T"].type).name
            for name, position in XLA_KERNELS.items():
                if node.op in CALL_OPS and name in node.attr["f"].func.name:
                    read[name] = tf.as_dtype(node.attr["Tin"].list.type[position]).name
        assert set(read) in (set(KERNEL_OPS), set(XLA_KERNELS)), read
        return set(read.values())


def _as_switched(forward, backward):
    """A path's `(forward, backward)` pair as the run-time switch runs it."""
    return functools.partial(_saved_gradient.normalize_with, forward, backward)


FORMS = {
    "whole_batch": (_batch_norm_formula.batch_norm_normalize, False),
    "whole_batch_switched": (
        _as_switched(
            _batch_norm_formula.batch_norm_forward,
            _batch_norm_formula.batch_norm_backward,
        ),
        True,
    ),
    "per_sample": (_per_sample_batch_norm.per_sample_normalize, False),
    "per_sample_loop": (_per_sample_batch_norm.per_sample_normalize, True),
    "kernels": (_fused_normalization.kernels_normalize, False),
    "kernels_switched": (
        _as_switched(
            _fused_normalization.kernels_forward,
            _fused_normalization.kernels_backward,
        ),
        True,
    ),
}


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize(
    "float16_arithmetic", (False, True), ids=("emulated", "native")
)
def test_float16_kernels_match_float64_widened_only_without_float16_arithmetic(
    form, float16_arithmetic, monkeypatch
):
    monkeypatch.setattr(
        _precision, "cpu_has_float16_arithmetic", lambda: float16_arithmetic
    )
    policy = use_policy("mixed_float16")
    normalize, any_batch = FORMS[form]
    for mean in (0.0, 1000.0):  # the kernel centers before it squares
        step = _Step(layers.InstanceNormalization(), normalize, any_batch)
        check_normalization(step, SHAPE, mean, policy, STAT_AXES, PARAMS)
    assert step.kernel_dtypes() == {"float16" if float16_arithmetic else "float32"}


@pytest.mark.parametrize(
    ("path", "any_batch"),
    (
        (_path_choice.BATCH_NORM, False),
        (_path_choice.PER_SAMPLE_BATCH_NORM, False),
        (_path_choice.PER_SAMPLE_BATCH_NORM, True),
        (_path_choice.FUSED_KERNELS, False),
        (_path_choice.FUSED_KERNELS, True),
    ),
)
def test_layer_fit_in_float16_without_float16_arithmetic_matches_float64(
    path, any_batch, monkeypatch
):
    # The layer as `fit` runs it: the forced path, float16 on a CPU without
    # float16 arithmetic, trained one epoch (one step, or two with a partial
    # last batch); its weights move as float64's.
    monkeypatch.setattr(_precision, "cpu_has_float16_arithmetic", lambda: False)
    monkeypatch.setattr(_per_sample_batch_norm, "MIN_SAMPLE_ELEMENTS", 1)
    monkeypatch.setenv(_path_choice.PATH_VARIABLE, path)
    use_policy("mixed_float16")
    rng = np.random.default_rng(0)
    x = rng.normal(3.0, 2.0, SHAPE).astype("float32")
    target = rng.normal(0.0, 1.0, SHAPE).astype("float32")
    layer = layers.InstanceNormalization()
    # The activation casts the float32 input to float16, as a model's
    # convolution would hand it over.
    to_float16 = keras.layers.Activation("linear")
    model = keras.Sequential([keras.Input(SHAPE[1:]), to_float16, layer])
    model.compile(keras.optimizers.SGD(0.5), "mse")
    batch_size = 3 if any_batch else SHAPE[0]  # any batch: a partial last batch
    model.fit(x, target, batch_size=batch_size, epochs=1, shuffle=False, verbose=0)
    gamma, beta = np.ones(SHAPE[-1]), np.zeros(SHAPE[-1])
    for start in range(0, SHAPE[0], batch_size):
        batch = slice(start, start + batch_size)
        gamma, beta = _sgd_step(x[batch], target[batch], gamma, beta)
    np.testing.assert_allclose(layer.gamma.numpy(), gamma, rtol=0, atol=4e-3)
    np.testing.assert_allclose(layer.beta.numpy(), beta, rtol=0, atol=4e-3)


def _sgd_step(x, target, gamma, beta, rate=0.5, epsilon=1e-3):
    """One float64 SGD step of an instance norm on mean squared error."""
    x, target = x.astype("float64"), target.astype("float64")
    centered = x - x.mean(axis=STAT_AXES, keepdims=True)
    variance = (centered**2).mean(axis=STAT_AXES, keepdims=True)
    normalized = centered / np.sqrt(variance + epsilon)
    upstream = 2.0 * (normalized * gamma + beta - target) / target.size
    gamma_grad = (upstream * normalized).sum(axis=(0, *STAT_AXES))
    beta_grad = upstream.sum(axis=(0, *STAT_AXES))
    return gamma - rate * gamma_grad, beta - rate * beta_grad

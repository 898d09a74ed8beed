"""What the backward pass keeps from the forward pass, read off the graph.

The memory-saving gradients keep only the layer's input (plus, for the
normalizations, three numbers per normalized slice): no sigmoid, no
normalized copy, no float32 copy of the input.
"""

import keras
import pytest
import tensorflow as tf

from keras_amp_plus import _compat, layers
from keras_amp_plus.layers import _path_choice, _precision

POLICIES = ("float32", "mixed_float16", "mixed_bfloat16")
SHAPE = (None, 6, 8)


def _kernel_calls(layer, compute_dtype, shape=SHAPE):
    """Return {function name: call op} of the forward/backward XLA kernels."""
    layer.build(shape)

    @tf.function(input_signature=[tf.TensorSpec(shape, compute_dtype)])
    def step(x):
        with tf.GradientTape() as tape:
            tape.watch(x)
            outputs = layer(x)
        return tape.gradient(
            outputs, [x, *layer.trainable_weights], tf.ones_like(outputs)
        )

    graph = step.get_concrete_function().graph
    calls = {}
    for op in graph.get_operations():
        if op.type in ("PartitionedCall", "StatefulPartitionedCall"):
            name = op.get_attr("f").name
            for kernel in ("forward", "backward"):
                if f"_{kernel}_" in name:
                    calls[kernel] = op
    return graph, calls


@pytest.mark.parametrize("policy", POLICIES)
def test_swish_backward_reads_only_the_input(policy):
    keras.config.set_dtype_policy(policy)
    compute = keras.config.dtype_policy().compute_dtype
    graph, calls = _kernel_calls(layers.Swish(trainable_beta=True), compute)
    forward, backward = calls["forward"], calls["backward"]
    assert len(forward.outputs) == 1  # no intermediates exported for backward
    x = graph.inputs[0]
    upstream, saved_x, beta = backward.inputs
    assert saved_x is x and saved_x.dtype == compute
    assert beta.shape.rank == 0 and upstream.dtype == compute


def test_onednn_swish_forward_leaves_its_sigmoid_to_the_product(monkeypatch):
    # oneDNN's fused kernel replaces `x * sigmoid(x)` only where the sigmoid
    # has no other reader: the backward pass must read x, not the sigmoid.
    monkeypatch.setattr(_compat, "onednn_enabled", lambda: True)
    keras.config.set_dtype_policy("mixed_bfloat16")
    graph, calls = _kernel_calls(layers.Swish(), "bfloat16")
    [sigmoid] = [op for op in graph.get_operations() if op.type == "Sigmoid"]
    x = graph.inputs[0]
    assert sigmoid.inputs[0] is x
    [product] = sigmoid.outputs[0].consumers()
    assert product.type == "Mul" and x in list(product.inputs)
    upstream, saved_x, beta = calls["backward"].inputs
    assert saved_x is x and beta.shape.rank == 0
    assert upstream.dtype == "bfloat16"


@pytest.mark.parametrize(
    "float16_arithmetic", (True, False), ids=("native", "emulated")
)
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("name", ["LayerNormalization", "InstanceNormalization"])
def test_normalization_backward_keeps_input_and_statistics(
    name, policy, float16_arithmetic, monkeypatch
):
    # The kernels' path (in a graph step of unknown batch size the layer may
    # otherwise switch between paths at run time, inside nested functions).
    # Instance norm runs in place; float16 instance norms on a CPU without
    # float16 arithmetic read their input widened, in each pass afresh.
    monkeypatch.setenv(_path_choice.PATH_VARIABLE, _path_choice.FUSED_KERNELS)
    monkeypatch.setattr(
        _precision, "cpu_has_float16_arithmetic", lambda: float16_arithmetic
    )
    keras.config.set_dtype_policy(policy)
    compute = keras.config.dtype_policy().compute_dtype
    if name == "LayerNormalization":
        layer, shape = layers.LayerNormalization(), SHAPE
    else:
        layer, shape = layers.InstanceNormalization(), (2, *SHAPE[1:])
    graph, calls = _kernel_calls(layer, compute, shape)
    forward, backward = calls["forward"], calls["backward"]
    x = graph.inputs[0]
    kernel_input = forward.inputs[0]
    widened = name == "InstanceNormalization" and _precision.emulated_float16(compute)
    if name == "LayerNormalization":  # (batch, 6, 8) as (rows, 8): a view of x
        assert kernel_input.op.type == "Reshape"
        assert kernel_input.op.inputs[0] is x
        assert kernel_input.shape.as_list() == [None, 8]
    elif widened:
        assert kernel_input.op.type == "Cast" and kernel_input.op.inputs[0] is x
        assert kernel_input.dtype == "float32"
    else:  # instance norm in place: x itself
        assert kernel_input is x
    # Full-size tensors read by the backward kernel: the upstream gradient and
    # the kernels' input, in the compute dtype (the widened input: a cast of
    # x made in the backward pass, so only x is kept); the rest is per-slice
    # statistics (shape 1 along the normalized axes) and the weights.
    size = kernel_input.shape.as_list()
    full_size = [t for t in backward.inputs if t.shape.as_list() == size]
    statistics = [t for t in backward.inputs if t.op is forward]
    assert len(full_size) == 2
    if widened:
        [read] = [t for t in full_size if t.op.type == "Cast"]
        assert read.op.inputs[0] is x and read.dtype == "float32"
        assert read is not kernel_input
        assert [t.dtype for t in full_size] == [compute, "float32"]
    else:
        assert any(t is kernel_input for t in backward.inputs)
        assert all(t.dtype == compute for t in full_size)
        assert [t is kernel_input for t in full_size].count(True) == 1
    assert len(statistics) == 3  # shift, mean and inverse standard deviation
    for statistic in statistics:
        assert statistic.dtype == "float32"
        assert 1 in statistic.shape.as_list()[1:]
    # The output itself is not kept.
    assert not any(t is forward.outputs[0] for t in backward.inputs)

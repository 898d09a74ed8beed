"""TensorFlow op types: which names exist, and which ones a Keras layer runs.

Graph engines (grappler, ITEX) only know op TYPES. When a layer-level entry
(`deny_layers=("LayerNormalization",)`) must take effect under a graph engine it
is translated to the op types of that layer's precision-sensitive work:

| layer class | op types |
| --- | --- |
| Dense | MatMul, BatchMatMulV2, BiasAdd, BiasAddGrad |
| EinsumDense | Einsum, MatMul, BatchMatMulV2, BiasAdd, BiasAddGrad |
| Conv1D, Conv2D | Conv2D, Conv2DBackpropInput, Conv2DBackpropFilter, BiasAdd(Grad) |
| Conv2DTranspose | Conv2DBackpropInput, Conv2D, Conv2DBackpropFilter, BiasAdd, ... |
| Conv3D | Conv3D, Conv3DBackpropInputV2, Conv3DBackpropFilterV2, BiasAdd, ... |
| DepthwiseConv2D | DepthwiseConv2dNative (+BackpropInput, +BackpropFilter), BiasAdd |
| SeparableConv2D | the DepthwiseConv2D and Conv2D op types |
| Layer-, Group-, Instance-, BatchNormalization | Mean, SquaredDifference, Rsqrt, |
| | FusedBatchNormV3, FusedBatchNormGradV3 |
| RMSNormalization | Mean, Square, Rsqrt |
| Softmax | Softmax |
| MultiHeadAttention | Einsum, BatchMatMulV2, MatMul, Softmax |
| Attention, AdditiveAttention, Dot | BatchMatMulV2, Softmax |
| LSTM, GRU, SimpleRNN | MatMul, BiasAdd, Sigmoid, SigmoidGrad, Tanh, TanhGrad |
| Embedding | GatherV2, ResourceGather |
| AveragePooling1D/2D/3D | AvgPool, AvgPoolGrad, AvgPool3D, AvgPool3DGrad |
| GlobalAveragePooling1D/2D/3D | Mean |
| Swish | Sigmoid, SigmoidGrad |

A layer with an `activation` also brings its activation's op types (softmax ->
Softmax, sigmoid/silu/swish -> Sigmoid, SigmoidGrad, tanh -> Tanh, TanhGrad, gelu
-> Erf, Tanh, log_softmax -> LogSoftmax, softplus -> Softplus, SoftplusGrad, elu
-> Elu, EluGrad, exponential -> Exp). Lookup follows the class's MRO, so
subclasses inherit their parent's entry; a container (a nested model) gets the
union of its layers' op types. Generic elementwise ops (Add, Mul, Sub) are left
out on purpose: graph lists act on every op of a type, and denying `Mul` for one
layer would turn most of the model to float32.
"""

import difflib
import functools

import tensorflow as tf

from keras_amp_plus import _compat
from keras_amp_plus._arguments import require_layer

_BIAS = ("BiasAdd", "BiasAddGrad")
_CONV2D = ("Conv2D", "Conv2DBackpropInput", "Conv2DBackpropFilter", *_BIAS)
_DEPTHWISE = (
    "DepthwiseConv2dNative",
    "DepthwiseConv2dNativeBackpropInput",
    "DepthwiseConv2dNativeBackpropFilter",
    *_BIAS,
)
_NORMALIZATION = (
    "Mean",
    "SquaredDifference",
    "Rsqrt",
    "FusedBatchNormV3",
    "FusedBatchNormGradV3",
)
_RNN = ("MatMul", "BiasAdd", "Sigmoid", "SigmoidGrad", "Tanh", "TanhGrad")
_AVG_POOL = ("AvgPool", "AvgPoolGrad", "AvgPool3D", "AvgPool3DGrad")

LAYER_OP_TYPES = {
    "Dense": ("MatMul", "BatchMatMulV2", *_BIAS),
    "EinsumDense": ("Einsum", "MatMul", "BatchMatMulV2", *_BIAS),
    "Conv1D": _CONV2D,
    "Conv2D": _CONV2D,
    "Conv1DTranspose": _CONV2D,
    "Conv2DTranspose": _CONV2D,
    "Conv3D": ("Conv3D", "Conv3DBackpropInputV2", "Conv3DBackpropFilterV2", *_BIAS),
    "Conv3DTranspose": (
        "Conv3D",
        "Conv3DBackpropInputV2",
        "Conv3DBackpropFilterV2",
        *_BIAS,
    ),
    "DepthwiseConv1D": _DEPTHWISE,
    "DepthwiseConv2D": _DEPTHWISE,
    "SeparableConv1D": (*_DEPTHWISE, "Conv2D"),
    "SeparableConv2D": (*_DEPTHWISE, "Conv2D"),
    "LayerNormalization": _NORMALIZATION,
    "GroupNormalization": _NORMALIZATION,
    "InstanceNormalization": _NORMALIZATION,
    "BatchNormalization": _NORMALIZATION,
    "RMSNormalization": ("Mean", "Square", "Rsqrt"),
    "Softmax": ("Softmax",),
    "MultiHeadAttention": ("Einsum", "BatchMatMulV2", "MatMul", "Softmax"),
    "Attention": ("BatchMatMulV2", "Softmax"),
    "AdditiveAttention": ("BatchMatMulV2", "Softmax"),
    "Dot": ("BatchMatMulV2",),
    "LSTM": _RNN,
    "GRU": _RNN,
    "SimpleRNN": _RNN,
    "Embedding": ("GatherV2", "ResourceGather"),
    "AveragePooling1D": _AVG_POOL,
    "AveragePooling2D": _AVG_POOL,
    "AveragePooling3D": _AVG_POOL,
    "GlobalAveragePooling1D": ("Mean",),
    "GlobalAveragePooling2D": ("Mean",),
    "GlobalAveragePooling3D": ("Mean",),
    "Swish": ("Sigmoid", "SigmoidGrad"),
}

ACTIVATION_OP_TYPES = {
    "softmax": ("Softmax",),
    "log_softmax": ("LogSoftmax",),
    "sigmoid": ("Sigmoid", "SigmoidGrad"),
    "silu": ("Sigmoid", "SigmoidGrad"),
    "swish": ("Sigmoid", "SigmoidGrad"),
    "tanh": ("Tanh", "TanhGrad"),
    "gelu": ("Erf", "Tanh"),
    "softplus": ("Softplus", "SoftplusGrad"),
    "elu": ("Elu", "EluGrad"),
    "exponential": ("Exp",),
}

# Op types that graph rewrites use but `tf.raw_ops` does not list: grappler's
# fused batch norm and oneDNN layer norm, and ITEX's fused ops (from ITEX's
# default AMP lists).
INTERNAL_OP_TYPES = (
    "_FusedBatchNormEx",
    "_MklLayerNorm",
    "LayerNorm",
    "LayerNormGrad",
    "ITEXLayerNorm",
    "ITEXLayerNormGrad",
    "_ITEXInstanceNorm",
    "_ITEXFusedInstanceNorm",
    "_ITEXSwish",
    "SwishGrad",
    "_ITEXMish",
    "ITEXGelu",
)


@functools.lru_cache(maxsize=1)
def known_op_types() -> frozenset:
    """Return every op type name TensorFlow registers (plus graph-internal ones)."""
    public = {name for name in dir(tf.raw_ops) if not name.startswith("_")}
    return frozenset(public | set(INTERNAL_OP_TYPES))


def check_op_types(op_types, field: str) -> None:
    """Raise ValueError for op types TensorFlow does not know, with suggestions.

    Args:
        op_types: iterable of op type names.
        field: the `PrecisionLists` field they came from, for the message.
    """
    known = known_op_types()
    for op_type in op_types:
        if op_type in known:
            continue
        close = difflib.get_close_matches(op_type, sorted(known), n=3, cutoff=0.6)
        hint = f" Did you mean {', '.join(close)}?" if close else ""
        raise ValueError(
            f"`{field}` holds {op_type!r}, which is not a TensorFlow op type. "
            "Op lists take op types as they appear in a graph (`MatMul`, "
            f"`Conv2D`, `Softmax`; see `dir(tf.raw_ops)`).{hint} "
            f"Received: {field}={tuple(op_types)!r}"
        )


def own_op_types(layer) -> tuple:
    """Return the op types of `layer` itself (its class and its activation).

    Unlike `op_types_for_layer`, a layer containing layers adds nothing of
    theirs.
    """
    found = ()
    for cls in type(layer).__mro__:
        if cls.__name__ in LAYER_OP_TYPES:
            found = LAYER_OP_TYPES[cls.__name__]
            break
    activation = getattr(layer, "activation", None)
    activation_name = getattr(activation, "__name__", None)
    return found + ACTIVATION_OP_TYPES.get(activation_name, ())


def op_types_for_layer(layer) -> tuple:
    """Return the op types that carry a layer's precision-sensitive work.

    The mapping is the table in this module's docstring. A layer that contains
    layers (a nested model, attention blocks) adds its sublayers' op types.

    Args:
        layer: a `keras.layers.Layer`.

    Returns:
        A tuple of op type names, without duplicates, in a stable order; empty
        for layers that run no such op (Flatten, Dropout, ...).

    Example:
    >>> import keras
    >>> from keras_amp_plus.engines import op_types_for_layer
    >>> op_types_for_layer(keras.layers.Dense(2, activation="softmax"))
    ('MatMul', 'BatchMatMulV2', 'BiasAdd', 'BiasAddGrad', 'Softmax')
    """
    require_layer(layer, "op_types_for_layer")
    op_types = list(own_op_types(layer))
    for sublayer in _compat.flatten_layers(layer):
        op_types.extend(own_op_types(sublayer))
    return tuple(dict.fromkeys(op_types))

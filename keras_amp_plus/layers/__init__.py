"""Mixed-precision layers: float32 weights and statistics, fused kernels."""

from keras_amp_plus.layers.instance_normalization import InstanceNormalization
from keras_amp_plus.layers.layer_normalization import LayerNormalization
from keras_amp_plus.layers.swish_activation import Swish, swish

__all__ = ["InstanceNormalization", "LayerNormalization", "Swish", "swish"]

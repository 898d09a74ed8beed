"""Mixed-precision layers: float32 weights and statistics, fused kernels."""

from keras_amp_plus.layers._instance_normalization import InstanceNormalization
from keras_amp_plus.layers._layer_normalization import LayerNormalization
from keras_amp_plus.layers._swish_activation import Swish, swish

__all__ = ["InstanceNormalization", "LayerNormalization", "Swish", "swish"]

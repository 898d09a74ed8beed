"""Drop-in `LayerNormalization` with float32 statistics and fused kernels."""

import keras
import tensorflow as tf

from keras_amp_plus import _compat, _itex_probe
from keras_amp_plus.layers import _validation
from keras_amp_plus.layers._fused_normalization import fused_normalize
from keras_amp_plus.layers._precision import broadcast_weights

_LAYER_NAME = "LayerNormalization"
_ITEX_MIN_EPSILON = 1.001e-5


def _itex_layer_norm_op(input_dtype):
    """Return ITEX's layer-norm op where it runs `input_dtype` here, else None."""
    itex_op = _compat.itex_layer_norm_op(input_dtype)
    dtype = tf.as_dtype(input_dtype).name
    if itex_op is None or dtype not in _itex_probe.LAYER_NORM_PROBE_DTYPES:
        return itex_op
    # ITEX's oneDNN has no half-precision layer-norm primitive on some CPUs
    # (float16 on an AMD EPYC with AVX512-BF16 only, both on ITEX's AVX2
    # backend) and the first call raises inside the step. The probe's child
    # costs seconds once per machine and dtype (cached on disk).
    status = _itex_probe.itex_layer_norm_status(dtype)
    return itex_op if status["works"] else None  # pragma: no cover


@keras.saving.register_keras_serializable(package="keras_amp_plus")
class LayerNormalization(keras.layers.LayerNormalization):
    """Layer normalization (Ba et al., 2016) with float32 statistics, fused.

    A drop-in for `keras.layers.LayerNormalization`: same arguments and
    defaults, same `get_config()` keys, same weights (`gamma` then `beta`, same
    shapes), masks pass through, so configs and weight files load either way.
    What differs is how it runs:

    - the mean and variance are always computed in float32 (float64 for
      float64 inputs), also under `mixed_bfloat16` / `mixed_float16` and under
      TensorFlow's graph-level `auto_mixed_precision_onednn_bfloat16` rewrite,
      which turns Keras's own statistics ops into bfloat16;
    - forward and backward each run as one XLA-fused kernel, and the backward
      pass keeps only the input and three numbers per row alive, wherever
      that is faster than Keras's formula on this CPU (also inside a
      `jit_compile=True` step, where it takes them at every size); where a
      graph-step measurement found Keras's formula faster, the layer runs
      that formula, statistics still float32; XLA compiles
      a kernel per input shape, so inputs whose length changes from batch to
      batch (`keras.Input((None, features))`) are padded to one of two row
      counts per power of two, bounding the compilations over a whole `fit`
      (eager calls run plain ops: they compile nothing);
    - with Intel Extension for TensorFlow importable, ITEX's fused layer-norm
      kernel is used for the last axis, for float16 only where a probe found
      it runs on this CPU (ITEX's AVX512 backend has no float16 layer norm on
      CPUs without AVX512-FP16).

    `gamma` and `beta` stay float32 under mixed policies; the output has the
    layer's compute dtype.

    Args:
        axis: Integer or list/tuple of integers, the axis or axes to normalize
            across (typically the features axis). Defaults to `-1`.
        epsilon: Positive float added to the variance. Defaults to `1e-3`.
        center: If True, add the offset `beta`. Defaults to `True`.
        scale: If True, multiply by `gamma`. Defaults to `True`.
        beta_initializer: Initializer for `beta`. Defaults to `"zeros"`.
        gamma_initializer: Initializer for `gamma`. Defaults to `"ones"`.
        beta_regularizer: Optional regularizer for `beta`. Defaults to `None`.
        gamma_regularizer: Optional regularizer for `gamma`. Defaults to `None`.
        beta_constraint: Optional constraint for `beta`. Defaults to `None`.
        gamma_constraint: Optional constraint for `gamma`. Defaults to `None`.
        **kwargs: Base layer keyword arguments (`name`, `dtype`, ...). The
            deprecated `rms_scaling` is accepted as Keras accepts it.

    Example:
    >>> import numpy as np
    >>> import keras_amp_plus
    >>> layer = keras_amp_plus.layers.LayerNormalization(dtype="mixed_bfloat16")
    >>> outputs = layer(np.array([[1000.0, 1001.0, 1002.0]]))
    >>> print(outputs.dtype.name, layer.gamma.dtype)
    bfloat16 float32
    >>> print(np.round(np.asarray(outputs, dtype="float32"), 2))
    [[-1.23  0.    1.23]]

    Reference:
    - [Lei Ba et al., 2016](https://arxiv.org/abs/1607.06450).
    """

    def __init__(
        self,
        axis: int | list[int] | tuple[int, ...] = -1,
        epsilon: float = 1e-3,
        center: bool = True,
        scale: bool = True,
        beta_initializer="zeros",
        gamma_initializer="ones",
        beta_regularizer=None,
        gamma_regularizer=None,
        beta_constraint=None,
        gamma_constraint=None,
        **kwargs,
    ):
        _validation.check_axis_type(axis, allow_list=True)
        epsilon = _validation.check_epsilon(epsilon)
        # Keras's own constructor accepts (and warns about) `rms_scaling`.
        super().__init__(
            axis=axis,
            epsilon=epsilon,
            center=center,
            scale=scale,
            beta_initializer=beta_initializer,
            gamma_initializer=gamma_initializer,
            beta_regularizer=beta_regularizer,
            gamma_regularizer=gamma_regularizer,
            beta_constraint=beta_constraint,
            gamma_constraint=gamma_constraint,
            **kwargs,
        )
        # Statistics are taken from the inputs as they come (as Keras 3's layer
        # does); Keras 2's base layer would round them to the compute dtype.
        _compat.disable_input_autocast(self)

    @classmethod
    def from_config(cls, config):
        """Create the layer from its config, as saved by Keras 3 or Keras 2."""
        return super().from_config(_compat.portable_layer_config(config))

    def build_from_config(self, config):
        """Build the layer as saved, its weights named after it (Keras 2 too)."""
        _compat.build_from_config(self, config, super().build_from_config)

    def build(self, input_shape):
        """Check the axes against the input, then create `gamma` and `beta`."""
        axes = self.axis if isinstance(self.axis, list) else [self.axis]
        rank = len(input_shape)
        positive = _validation.positive_axes(axes, rank, input_shape)
        _validation.check_defined_dims(positive, input_shape, _LAYER_NAME)
        super().build(input_shape)

    def call(self, inputs):
        """Normalize `inputs`; statistics in float32, output in compute dtype."""
        inputs = _validation.as_float_input(inputs, _LAYER_NAME, self.compute_dtype)
        rank = len(inputs.shape)
        axes = _validation.positive_axes(self.axis, rank, inputs.shape)
        if _compat.uses_rms_scaling(self):
            return self._rms_scaled(inputs, axes)
        itex_op = _itex_layer_norm_op(inputs.dtype)
        # ITEX's kernel normalizes the last axis only and raises epsilon to its
        # own minimum, which would change the result.
        itex_applies = axes == (rank - 1,) and self.epsilon >= _ITEX_MIN_EPSILON
        if itex_op is not None and itex_applies:  # pragma: no cover
            return self._itex_normalized(itex_op, inputs)
        gamma, beta = self._broadcast_weights(inputs, axes)
        return fused_normalize(
            inputs, gamma, beta, self.epsilon, axes, self.compute_dtype
        )

    def _broadcast_weights(self, inputs, axes):
        """Return gamma and beta reshaped to broadcast against `inputs`."""
        return broadcast_weights(self.gamma, self.beta, inputs, axes)

    def _rms_scaled(self, inputs, axes):
        """Keras's deprecated `rms_scaling` formula, statistics in float32."""
        gamma, _ = self._broadcast_weights(inputs, axes)
        x = tf.cast(inputs, gamma.dtype)
        variance = tf.math.reduce_variance(x, axis=axes, keepdims=True)
        outputs = x * tf.math.rsqrt(variance + self.epsilon) * gamma
        return tf.cast(outputs, self.compute_dtype)

    def _itex_normalized(self, itex_op, inputs):  # pragma: no cover - ITEX stack
        """Run ITEX's fused kernel (float32 statistics) on the last axis."""
        gamma, beta = self._broadcast_weights(inputs, (len(inputs.shape) - 1,))
        outputs, _, _ = itex_op(
            inputs,
            tf.reshape(gamma, [-1]),
            tf.reshape(beta, [-1]),
            epsilon=self.epsilon,
            is_training=True,
            data_format="NHWC",
        )
        return tf.cast(outputs, self.compute_dtype)

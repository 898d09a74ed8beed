"""`InstanceNormalization` with float32 statistics, loading TF Addons configs."""

import keras

from keras_amp_plus import _compat
from keras_amp_plus.layers import _validation
from keras_amp_plus.layers._fused_normalization import fused_normalize
from keras_amp_plus.layers._precision import broadcast_weights

_LAYER_NAME = "InstanceNormalization"


@keras.saving.register_keras_serializable(package="keras_amp_plus")
class InstanceNormalization(keras.layers.Layer):
    """Instance normalization (Ulyanov et al., 2016) with float32 statistics.

    Normalizes each channel of each sample over all its other non-batch axes
    (height and width for images), then applies a per-channel `gamma` and
    `beta`. In float32 it equals `keras.layers.GroupNormalization(groups=-1)`.
    Statistics are computed in float32 under every policy, by whichever
    implementation is fastest at the input's shape on this CPU: XLA-fused
    forward and backward kernels, TensorFlow's fused batch-norm kernel (in
    graph steps) or Keras's formula (see `LayerNormalization`).
    `gamma`/`beta` stay float32
    under mixed policies and the output has the layer's compute dtype. XLA
    compiles a kernel per input shape: a model fed images of many different
    sizes compiles once per size.

    Configs saved by TF Addons' `InstanceNormalization`
    (`"Addons>InstanceNormalization"`) load into this layer. Their `groups` key
    must be -1 or the number of channels (both mean instance normalization);
    any other value raises instead of being silently replaced.

    Args:
        axis: Integer, the channels axis. Defaults to `-1`.
        epsilon: Positive float added to the variance. Defaults to `1e-3`.
        center: If True, add the per-channel offset `beta`. Defaults to `True`.
        scale: If True, multiply by the per-channel `gamma`. Defaults to `True`.
        beta_initializer: Initializer for `beta`. Defaults to `"zeros"`.
        gamma_initializer: Initializer for `gamma`. Defaults to `"ones"`.
        beta_regularizer: Optional regularizer for `beta`. Defaults to `None`.
        gamma_regularizer: Optional regularizer for `gamma`. Defaults to `None`.
        beta_constraint: Optional constraint for `beta`. Defaults to `None`.
        gamma_constraint: Optional constraint for `gamma`. Defaults to `None`.
        **kwargs: Base layer keyword arguments (`name`, `dtype`, ...), and
            `groups` from TF Addons configs (see above).

    Example:
    >>> import numpy as np
    >>> import keras_amp_plus
    >>> layer = keras_amp_plus.layers.InstanceNormalization(dtype="mixed_bfloat16")
    >>> images = np.array([[[[1000.0, 0.0]], [[1002.0, 4.0]]]])  # (1, 2, 1, 2)
    >>> outputs = layer(images)
    >>> print(outputs.dtype.name, layer.gamma.dtype)
    bfloat16 float32
    >>> print(np.round(np.asarray(outputs, dtype="float32")[0, :, 0], 2))
    [[-1. -1.]
     [ 1.  1.]]

    Reference:
    - [Ulyanov et al., 2016](https://arxiv.org/abs/1607.08022).
    """

    def __init__(
        self,
        axis: int = -1,
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
        # TF Addons configs carry `groups`; it is checked against the channel
        # count in build() and never rewritten.
        self._addons_groups = kwargs.pop("groups", None)
        self._channels = None
        super().__init__(**kwargs)
        _validation.check_axis_type(axis, allow_list=False)
        self._check_addons_groups(channels=None)
        self.axis = axis
        self.epsilon = _validation.check_epsilon(epsilon)
        self.center = center
        self.scale = scale
        self.beta_initializer = keras.initializers.get(beta_initializer)
        self.gamma_initializer = keras.initializers.get(gamma_initializer)
        self.beta_regularizer = keras.regularizers.get(beta_regularizer)
        self.gamma_regularizer = keras.regularizers.get(gamma_regularizer)
        self.beta_constraint = keras.constraints.get(beta_constraint)
        self.gamma_constraint = keras.constraints.get(gamma_constraint)
        self.supports_masking = True
        _compat.disable_input_autocast(self)

    @property
    def groups(self) -> int:
        """The number of groups, one per channel, as TF Addons' layer had it.

        The channel count once built; before, the `groups` of a TF Addons
        config, else -1 ("one group per channel", GroupNormalization's
        spelling). Not a constructor argument: `get_config()` leaves it out.
        """
        if self._channels is not None:
            return self._channels
        return -1 if self._addons_groups is None else self._addons_groups

    def _check_addons_groups(self, channels):
        """Raise unless a TF Addons `groups` means one group per channel."""
        groups = self._addons_groups
        if groups is None or groups == -1:
            return
        is_count = isinstance(groups, int) and not isinstance(groups, bool)
        # Before build() the channel count is unknown: any positive count may
        # still turn out to equal it.
        if is_count and (groups == channels or (channels is None and groups > 0)):
            return
        raise ValueError(
            "InstanceNormalization normalizes each channel on its own, so "
            "`groups` (from a TF Addons config) must be -1 or the number of "
            f"channels ({channels if channels is not None else 'unknown yet'}). "
            "For other group counts use `keras.layers.GroupNormalization`. "
            f"Received: groups={groups!r}"
        )

    def build(self, input_shape):
        """Check the input's rank and channels, then create `gamma`, `beta`."""
        rank = len(input_shape)
        if rank < 3:
            raise ValueError(
                "InstanceNormalization needs inputs with a batch axis, at least "
                "one axis to normalize over and a channels axis (rank >= 3, e.g. "
                "(batch, height, width, channels)). For (batch, features) inputs "
                f"use LayerNormalization. Received: input_shape={tuple(input_shape)}"
            )
        (channel_axis,) = _validation.positive_axes([self.axis], rank, input_shape)
        if channel_axis == 0:
            raise ValueError(
                "`axis` is the channels axis and cannot be the batch axis 0. "
                f"Received: axis={self.axis}"
            )
        _validation.check_defined_dims([channel_axis], input_shape, _LAYER_NAME)
        channels = input_shape[channel_axis]
        self._check_addons_groups(channels)
        self._channels = channels
        self.gamma = self._add_channel_weight("gamma", channels, self.scale)
        self.beta = self._add_channel_weight("beta", channels, self.center)
        self.built = True  # Keras 2 builds again on the first call otherwise

    def _add_channel_weight(self, name, channels, enabled):
        """Add a float32 per-channel weight named like GroupNormalization's."""
        if not enabled:
            return None
        return self.add_weight(
            name=name,
            shape=(channels,),
            initializer=getattr(self, f"{name}_initializer"),
            regularizer=getattr(self, f"{name}_regularizer"),
            constraint=getattr(self, f"{name}_constraint"),
            **_compat.no_autocast(),
        )

    def call(self, inputs):
        """Normalize `inputs`; statistics in float32, output in compute dtype."""
        inputs = _validation.as_float_input(inputs, _LAYER_NAME, self.compute_dtype)
        rank = len(inputs.shape)
        channel_axis = self.axis % rank
        stat_axes = tuple(a for a in range(1, rank) if a != channel_axis)
        gamma, beta = broadcast_weights(self.gamma, self.beta, inputs, (channel_axis,))
        return fused_normalize(
            inputs, gamma, beta, self.epsilon, stat_axes, self.compute_dtype
        )

    def compute_output_shape(self, input_shape):
        """Return `input_shape`: normalization keeps the shape."""
        return input_shape

    @classmethod
    def from_config(cls, config):
        """Create the layer from its config, as saved by Keras 3 or Keras 2."""
        return super().from_config(_compat.portable_layer_config(config))

    def build_from_config(self, config):
        """Build the layer as saved, its weights named after it (Keras 2 too)."""
        _compat.build_from_config(self, config, super().build_from_config)

    def get_config(self):
        """Return the constructor arguments; identical before and after build."""
        serialize = {
            "initializer": keras.initializers.serialize,
            "regularizer": keras.regularizers.serialize,
            "constraint": keras.constraints.serialize,
        }
        config = {
            "axis": self.axis,
            "epsilon": self.epsilon,
            "center": self.center,
            "scale": self.scale,
        }
        for weight in ("beta", "gamma"):
            for kind, to_config in serialize.items():
                key = f"{weight}_{kind}"
                config[key] = to_config(getattr(self, key))
        return {**super().get_config(), **config}


# TF Addons saved this layer as "Addons>InstanceNormalization". An alias in the
# custom-object table (not a second registration, which would also change the
# name this class serializes under) lets those configs load into this class.
keras.saving.get_custom_objects()["Addons>InstanceNormalization"] = (
    InstanceNormalization
)

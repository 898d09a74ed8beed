"""Which layer caused an overflow event.

Layers are named by their name chain from the model down
(`keras_amp_plus.engines.layer_names.layer_chains`), which every layer has,
weights or not, and which survives nesting and `load_model`.

Backward overflow (the loss is finite, a gradient is not): once a gradient
overflows at layer L, every layer upstream of L (closer to the input) receives
non-finite gradients too, while layers downstream stay finite. The originating
layer is therefore the implicated layer closest to the loss in forward order,
the order in which the step called the layers (recorded while it was traced).

Forward overflow (the loss itself is Inf/NaN, so every gradient is): the batch
of the offending step is replayed eagerly with every layer's `call` wrapped, and
the first layer, in the order the calls finish, whose inputs are finite but
whose output is not is the one that overflowed: calls finish from the inside
out, so this is the innermost such layer (MultiHeadAttention itself when its
attention scores, computed between its sublayers, overflow), or the layer
inside it whose cast of those inputs overflowed (a nested model's first
layer: `_cast_overflow_inside`). Layers are
wrapped through an instance attribute restored in `finally`, and non-trainable
variables (batch norm statistics, seed generator states) are put back after the
replay, so the replay leaves no trace in the model.
"""

import keras
import numpy as np
import tensorflow as tf

from keras_amp_plus import _compat
from keras_amp_plus._lists.layer_names import layer_chains
from keras_amp_plus.optimizers import LossScaleOptimizer

BAD_DATA = "bad_data"  # the replayed batch itself holds Inf/NaN
# A float32 layer whose output came out in 16 bits: something runs it under
# another layer's policy (by its `call`), so its own policy does not apply.
OUTPUT_OUTSIDE_ITS_POLICY = "output, in 16 bits under its float32 policy"


class LayerIndex:
    """Layers of a model by name chain, in forward order, and variable owners.

    Forward order is the order in which the train step called the leaf layers
    (`set_call_order`, recorded while the step was traced); until it is known,
    the order of the layers flattened recursively.

    Args:
        model: a built Keras model.
    """

    def __init__(self, model):
        self.model = model
        self.chains = layer_chains(model)
        self.layers = [
            layer
            for layer in _compat.flatten_layers(model)
            if not isinstance(layer, keras.layers.InputLayer)
        ]
        leaves = [layer for layer in self.layers if not _sublayers(layer)]
        self.order = {self.chain(layer): i for i, layer in enumerate(leaves)}
        self.by_path = {self.chain(layer): layer for layer in self.layers}
        self.owner_of_variable = {}
        owner_by_id = {}
        for layer in leaves:
            for variable in layer.trainable_variables:
                path = _compat.variable_path(variable)
                self.owner_of_variable.setdefault(path, self.chain(layer))
                owner_by_id.setdefault(id(variable), self.chain(layer))
        self._bind_scaler_paths(getattr(model, "optimizer", None), owner_by_id)

    def _bind_scaler_paths(self, optimizer, owner_by_id) -> None:
        """Map our scaler's record paths to the layers owning their variables.

        By the variables themselves: paths may repeat between layers (see
        `LossScaleOptimizer.tracked_variable_paths`).
        """
        if not isinstance(optimizer, LossScaleOptimizer):
            return
        if not _compat.optimizer_built(optimizer):
            return
        paths = optimizer.tracked_variable_paths()
        for path, variable in zip(paths, optimizer.tracked_variables(), strict=True):
            owner = owner_by_id.get(id(variable))
            if owner is not None:
                self.owner_of_variable[path] = owner

    def chain(self, layer) -> str:
        """Return the name chain of `layer` (its identity in lists and logs)."""
        return self.chains.get(id(layer), layer.name)

    def set_call_order(self, layers) -> None:
        """Use the order the step called `layers` in as the forward order."""
        if layers:
            self.order = {self.chain(layer): i for i, layer in enumerate(layers)}

    def layers_of_variables(self, variable_paths) -> list[str]:
        """Return the layers owning `variable_paths`, in forward order."""
        owners = {
            self.owner_of_variable[path]
            for path in variable_paths
            if path in self.owner_of_variable
        }
        return sorted(owners, key=lambda path: self.order.get(path, -1))

    def backward_origin(self, implicated_layers) -> str | None:
        """Return the implicated layer closest to the loss (see module doc)."""
        return implicated_layers[-1] if implicated_layers else None


def _sublayers(layer):
    return [
        sub
        for sub in _compat.flatten_layers(layer)
        if not isinstance(sub, keras.layers.InputLayer)
    ]


def _all_finite(structure) -> bool:
    for value in tf.nest.flatten(structure):
        if not isinstance(value, (tf.Tensor, tf.Variable, np.ndarray)):
            continue
        tensor = tf.convert_to_tensor(value)
        if tensor.dtype.is_floating and not bool(
            tf.reduce_all(tf.math.is_finite(tensor))
        ):
            return False
    return True


def _outside_its_policy(layer, outputs) -> bool:
    """Return True when a float32 layer's floating outputs came out in 16 bits."""
    if layer.compute_dtype != "float32":
        return False
    return any(
        isinstance(value, (tf.Tensor, tf.Variable))
        and value.dtype in (tf.float16, tf.bfloat16)
        for value in tf.nest.flatten(outputs)
    )


def _cast_overflow_inside(inputs, inside):
    """Return the layer called inside a container that overflowed casting its inputs.

    A nested model hands its finite float32 inputs to its first layer, whose
    cast to float16 overflows: the container's output is the first
    non-finite output, but the layer is to blame. That is the first layer
    called inside (`inside`: `(layer, inputs finite)` in call order) when its
    inputs were not finite and the container's own inputs, cast to that
    layer's compute dtype, are not finite either; else None (the values went
    bad between the layers, as attention scores inside `MultiHeadAttention`
    do: the container is to blame).
    """
    if not inside or inside[0][1]:
        return None
    layer = inside[0][0]
    dtype = tf.as_dtype(layer.compute_dtype)

    def cast(value):
        if isinstance(value, (tf.Tensor, tf.Variable, np.ndarray)):
            tensor = tf.convert_to_tensor(value)
            if tensor.dtype.is_floating:
                return tf.cast(tensor, dtype)
        return value

    return None if _all_finite(tf.nest.map_structure(cast, inputs)) else layer


def find_forward_overflow(model, data, layers, name=None) -> dict:
    """Replay `data` through `model` and return where the forward pass overflowed.

    Args:
        model: the Keras model.
        data: one training batch as `fit` passes it to `train_step`.
        layers: the layers to watch (a `LayerIndex`'s `layers`).
        name: function giving a layer's name in the result (`LayerIndex.chain`).
            Defaults to `None` (the Keras path, else the layer's name).

    Returns:
        `{"layer": name or None, "reason": str}`. `reason` is one of
        `"output"` (finite inputs, non-finite output; `OUTPUT_OUTSIDE_ITS_POLICY`
        where that output is 16-bit from a float32 layer), `"input_cast"` (the layer's
        inputs became non-finite when cast to its compute dtype), `"bad_data"`
        (the batch itself holds Inf/NaN), `"non-finite weights in <path>"` (an
        unguarded update already broke the weights) or `"not_reproduced"`.
    """
    name = name or (lambda layer: _compat.layer_path(layer) or layer.name)
    x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
    if not _all_finite(x):
        return {"layer": None, "reason": BAD_DATA}
    entered, finished = [], []
    originals = {}

    def wrap(layer):
        original = layer.call

        def probed_call(*args, **kwargs):
            inputs_finite = _all_finite((args, kwargs))
            first_inside = len(entered) + 1
            entered.append((layer, inputs_finite))
            outputs = original(*args, **kwargs)
            cast_inside = None
            if inputs_finite:
                cast_inside = _cast_overflow_inside(
                    (args, kwargs), entered[first_inside:]
                )
            # Facts only: keeping the outputs would hold every activation.
            finished.append(
                (
                    layer,
                    inputs_finite,
                    _all_finite(outputs),
                    cast_inside,
                    _outside_its_policy(layer, outputs),
                )
            )
            return outputs

        return probed_call

    saved_state = [v.numpy() for v in model.non_trainable_variables]
    try:
        for layer in layers:
            originals[id(layer)] = (layer, layer.__dict__.get("call"))
            layer.call = wrap(layer)
        model(x, training=True)
    finally:
        for layer, previous in originals.values():
            if previous is None:
                layer.__dict__.pop("call", None)
            else:
                layer.call = previous
        for variable, value in zip(
            model.non_trainable_variables, saved_state, strict=True
        ):
            variable.assign(value)
    for layer, inputs_finite, outputs_finite, cast_inside, outside in finished:
        if inputs_finite and not outputs_finite:
            if cast_inside is not None:
                return {"layer": name(cast_inside), "reason": "input_cast"}
            path = name(layer)
            if not _all_finite([tf.convert_to_tensor(w) for w in layer.weights]):
                # Weights already broken by an earlier unguarded update: the
                # replay cannot tell where the overflow began.
                return {"layer": None, "reason": f"non-finite weights in {path}"}
            if outside:
                return {"layer": path, "reason": OUTPUT_OUTSIDE_ITS_POLICY}
            return {"layer": path, "reason": "output"}
    for layer, inputs_finite in entered:
        if not inputs_finite:
            return {"layer": name(layer), "reason": "input_cast"}
    return {"layer": None, "reason": "not_reproduced"}

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
inside it whose cast of the finite values it was handed overflowed (a nested
model's first layer, or one after a layer denied to float32:
`_cast_overflow_inside`). Layers are
wrapped through an instance attribute restored in `finally`, and non-trainable
variables (batch norm statistics, seed generator states) are put back after the
replay, so the replay leaves no trace in the model.
"""

from typing import NamedTuple

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


class _Entry(NamedTuple):
    """A layer's call began: its inputs' finiteness, and how many calls had ended."""

    layer: object
    inputs_finite: bool
    ends_before: int


class _End(NamedTuple):
    """A layer's call ended: the facts the replay keeps (never its outputs)."""

    layer: object
    inputs_finite: bool
    outputs_finite: bool
    cast_inside: object  # `_cast_overflow_inside`'s layer, or None
    outside_its_policy: bool
    largest: float  # the largest magnitude of its floating outputs


def _largest_magnitude(structure) -> float:
    """Return the largest |value| of the floating tensors in `structure`, or 0.0."""
    largest = 0.0
    for value in tf.nest.flatten(structure):
        if isinstance(value, (tf.Tensor, tf.Variable, np.ndarray)):
            tensor = tf.convert_to_tensor(value)
            if tensor.dtype.is_floating and tensor.shape.num_elements():
                largest = max(largest, float(tf.reduce_max(tf.abs(tensor))))
    return largest


def _finite_in(value: float, dtype) -> bool:
    """Return whether `value` stays finite when cast to `dtype`."""
    return bool(tf.math.is_finite(tf.cast(tf.constant(value, tf.float64), dtype)))


def _cast_overflow_inside(inputs, inside, finished, ends_before):
    """Return the layer called inside a container that overflowed casting its inputs.

    A nested model hands finite float32 values to a layer whose cast to
    float16 overflows: its own inputs (a float32 model input, or the output
    of a layer denied to float32 before it) are finite, so the container's
    output is the first non-finite output, but the layer is to blame. That
    is the first layer called inside (`inside`: `_Entry`s in call order)
    whose inputs were not finite, when the values it was handed overflow
    its compute dtype: the container's own inputs, if no call inside had
    ended before it began, else the finite output of the call that ended
    last before it began (`finished`: the `_End`s in order, those of calls
    inside the container from index `ends_before`, the count when it
    began), which a layer after a float32 one receives.
    Otherwise None: the values went bad between the layers, as attention
    scores inside `MultiHeadAttention` do, and the container is to blame.
    """
    entry = next((entry for entry in inside if not entry.inputs_finite), None)
    if entry is None:
        return None
    dtype = tf.as_dtype(entry.layer.compute_dtype)
    if entry.ends_before == ends_before:  # nothing ended inside before it
        return None if _all_finite(_cast_floats(inputs, dtype)) else entry.layer
    last = finished[entry.ends_before - 1]
    overflowing = last.outputs_finite and not _finite_in(last.largest, dtype)
    return entry.layer if overflowing else None


def _cast_floats(structure, dtype):
    """Return `structure` with its floating tensors cast to `dtype`."""

    def cast(value):
        if isinstance(value, (tf.Tensor, tf.Variable, np.ndarray)):
            tensor = tf.convert_to_tensor(value)
            if tensor.dtype.is_floating:
                return tf.cast(tensor, dtype)
        return value

    return tf.nest.map_structure(cast, structure)


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
            first_inside, ends_before = len(entered) + 1, len(finished)
            entered.append(_Entry(layer, inputs_finite, ends_before))
            outputs = original(*args, **kwargs)
            cast_inside = None
            if inputs_finite:
                cast_inside = _cast_overflow_inside(
                    (args, kwargs), entered[first_inside:], finished, ends_before
                )
            outputs_finite = _all_finite(outputs)
            # Facts only: keeping the outputs would hold every activation.
            finished.append(
                _End(
                    layer,
                    inputs_finite,
                    outputs_finite,
                    cast_inside,
                    _outside_its_policy(layer, outputs),
                    _largest_magnitude(outputs) if outputs_finite else np.inf,
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
    for end in finished:
        if end.inputs_finite and not end.outputs_finite:
            if end.cast_inside is not None:
                return {"layer": name(end.cast_inside), "reason": "input_cast"}
            path = name(end.layer)
            if not _all_finite([tf.convert_to_tensor(w) for w in end.layer.weights]):
                # Weights already broken by an earlier unguarded update: the
                # replay cannot tell where the overflow began.
                return {"layer": None, "reason": f"non-finite weights in {path}"}
            if end.outside_its_policy:
                return {"layer": path, "reason": OUTPUT_OUTSIDE_ITS_POLICY}
            return {"layer": path, "reason": "output"}
    for entry in entered:
        if not entry.inputs_finite:
            return {"layer": name(entry.layer), "reason": "input_cast"}
    return {"layer": None, "reason": "not_reproduced"}

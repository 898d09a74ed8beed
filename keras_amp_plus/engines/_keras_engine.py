"""The `keras` engine: layer lists as per-layer Keras dtype policies.

deny -> `"float32"`; allow -> the layer's own policy where it computed in 16
bits before this engine first touched it (mixed, or pure `"float16"` /
`"bfloat16"` with 16-bit variables), else the mixed policy of the 16-bit
compute dtype in use (the model's, else a layer's, else the global policy's,
else `"mixed_bfloat16"`); a layer in neither list gets back the policy it had
before this engine first touched it, so moves are reversible. The policy is
part of each layer's config, so the choice survives `model.save` /
`keras.saving.load_model`.

Policies are swapped with the `layer.dtype_policy` setter: variables stay as
they are (float32 / mixed_bfloat16 / mixed_float16 all keep float32 variables).
A layer of a pure 16-bit policy (`"float16"`: 16-bit variables) is not moved
to float32 when denied: Keras has no policy computing in float32 on 16-bit
variables, and a layer reading its kernel without a cast (Conv2D) would fail.
On Keras 2 a layer built under a float32 policy is not moved to 16 bits when
allowed, with a warning: Keras 2 casts only the variables a layer built under
a mixed policy made (`_compat.reads_weights_in_compute_dtype`).
"""

import logging

import keras
import tensorflow as tf

from keras_amp_plus import _compat
from keras_amp_plus._arguments import require_model
from keras_amp_plus._lists import layer_names
from keras_amp_plus._lists.precision_lists import (
    OP_FIELDS,
    PrecisionLists,
    as_precision_lists,
)
from keras_amp_plus.engines._base import Engine, rebuild_functions, remember_engine

logger = logging.getLogger("keras_amp_plus")

DEFAULT_MIXED_POLICY = "mixed_bfloat16"
KEPT_IN_FLOAT32 = (
    "keras_amp_plus: layer %r stays in float32 although its lists allow 16 "
    "bits: on Keras 2 a layer built under a float32 policy (a float32 "
    "model's, or one reloaded from a file that saved it denied) holds plain "
    "float32 variables, which Keras 2 does not cast, and ops such as Dense's "
    "and Conv2D's fail on them with 16-bit inputs. Build the model under the "
    "mixed policy "
    "(`tf.keras.mixed_precision.set_global_policy`) and give the layer "
    "`dtype='float32'` only where it must stay in float32."
)
KEPT_FOR_UNCAST_CONSUMERS = (
    "keras_amp_plus: layer %r stays in %s although its lists move it: on "
    "Keras 2 its outputs feed %s, which cast no inputs (a `+`, `*` or `tf.*` "
    "call in a functional model becomes such a layer), and a float32 tensor "
    "meeting a 16-bit one there fails the step. Write the operation as a "
    "Keras layer (`keras.layers.Add()`, `Multiply()`, `Concatenate()`), "
    "which casts its inputs, to let the layer change precision."
)
_LOW_PRECISION = ("bfloat16", "float16")


def computes_in_16_bits(policy) -> bool:
    """Return True for a policy computing in bfloat16 or float16 (mixed or pure)."""
    return _compat.dtype_policy(policy).compute_dtype in _LOW_PRECISION


def holds_16_bit_variables(layer) -> bool:
    """Return True for a layer with 16-bit variables (a pure 16-bit policy's).

    Example:
    >>> import keras
    >>> layer = keras.layers.Dense(2, dtype="float16")
    >>> layer.build((None, 3))
    >>> holds_16_bit_variables(layer)
    True
    """
    return any(
        tf.as_dtype(weight.dtype).name in _LOW_PRECISION for weight in layer.weights
    )


def model_has_16_bit_policy(model) -> bool:
    """Return True when the global policy or one of the model's computes in 16 bits."""
    layers = [model, *layer_names.candidate_layers(model)]
    return computes_in_16_bits(_compat.global_policy()) or any(
        computes_in_16_bits(layer.dtype_policy) for layer in layers
    )


class KerasEngine(Engine):
    """Apply layer lists through Keras dtype policies.

    Op lists (`allow_ops`, ...) have no meaning at layer level: `apply` rejects
    them. `restore()` touches nothing, since the per-layer choice is meant to
    outlive training (it is saved with the model); `apply(model,
    PrecisionLists())` puts every layer back to its original policy.

    Example:
    >>> import keras
    >>> from keras_amp_plus import PrecisionLists
    >>> from keras_amp_plus.engines import KerasEngine
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> KerasEngine().apply(model, PrecisionLists(allow_layers=("Dense",)))
    >>> model.layers[0].compute_dtype
    'bfloat16'
    """

    name = "keras"
    level = "layer"

    def __init__(self):
        self._original_policies = {}
        self._kept_layers = set()  # ids of layers said to stay in float32

    def mixed_policy(self, model):
        """Return the policy allowed layers get (see the module docstring)."""
        originals = [policy for _, policy in self._original_policies.values()]
        layers = layer_names.candidate_layers(model)
        candidates = [
            model.dtype_policy,
            *originals,
            *(layer.dtype_policy for layer in layers),
            _compat.global_policy(),
        ]
        for policy in candidates:
            # A pure 16-bit policy too ("float16" everywhere): its compute
            # dtype, on the allowed layer's float32 variables.
            if computes_in_16_bits(policy):
                # By dtype, not by name: a DTypePolicyMap is named after itself.
                return _compat.dtype_policy(f"mixed_{policy.compute_dtype}")
        return _compat.dtype_policy(DEFAULT_MIXED_POLICY)

    def apply(self, model: keras.Model, lists: PrecisionLists) -> None:
        """Set every listed layer's dtype policy; rebuild the functions if any changed.

        Args:
            model: the Keras model the lists refer to.
            lists: a `keras_amp_plus.PrecisionLists` without op lists (or its
                config dict).
        """
        require_model(model, "KerasEngine.apply")
        lists = as_precision_lists(lists)
        self.check_lists(lists)
        decisions = _decided_owners(
            model,
            layer_names.layer_decisions(model, lists.allow_layers, lists.deny_layers),
        )
        mixed = self.mixed_policy(model)
        float32 = _compat.dtype_policy("float32")
        changed = False
        for layer in layer_names.candidate_layers(model):
            if id(layer) in decisions:
                _, kind = decisions[id(layer)]
                _, original = self._original_policies.setdefault(
                    id(layer), (layer, layer.dtype_policy)
                )
                # Allowed, a layer the user gave a 16-bit policy of its own
                # keeps it (mixed_float16 in a mixed_bfloat16 model; "float16"
                # on the float16 variables it was built with).
                allowed = original if computes_in_16_bits(original) else mixed
                policy = float32 if kind == "deny" else allowed
                # A layer that ran in 16 bits before can again.
                if (
                    kind != "deny"
                    and not computes_in_16_bits(original)
                    and not _compat.reads_weights_in_compute_dtype(layer)
                ):
                    policy = self._kept_in_float32(layer)
                if kind == "deny" and holds_16_bit_variables(layer):
                    # Keras has no policy computing in float32 on 16-bit
                    # variables: a layer reading its kernel without a cast
                    # (Conv2D) would fail in float32. It stays as it is (the
                    # monitor says so: `_checks.policy_out_of_reach`).
                    policy = original
                if policy.compute_dtype != layer.dtype_policy.compute_dtype:
                    policy = self._kept_for_uncast_consumers(layer, policy)
                changed |= self._set_policy(layer, policy)
            elif id(layer) in self._original_policies:
                _, original = self._original_policies.pop(id(layer))
                changed |= self._set_policy(layer, original)
        remember_engine(model, self)
        # Lists applied again unchanged (each `fit` starts by applying them)
        # leave the traced functions valid: tracing again costs seconds, and
        # an XLA compilation more, on a large model.
        if changed:
            rebuild_functions(model)

    def check_lists(self, lists: PrecisionLists) -> None:
        """Raise when `lists` holds op types: they need a graph engine.

        Args:
            lists: a `keras_amp_plus.PrecisionLists`.
        """
        op_entries = {f: getattr(lists, f) for f in OP_FIELDS if getattr(lists, f)}
        if op_entries:
            raise ValueError(
                "The 'keras' engine works on layers; op-type lists need a graph "
                "engine. Use engine='grappler' (or 'itex'), or move the entries "
                f"to `allow_layers`/`deny_layers`. Received: {op_entries}"
            )

    def _kept_in_float32(self, layer):
        """Return the policy `layer` keeps; say once why it stays as it is."""
        if id(layer) not in self._kept_layers:
            self._kept_layers.add(id(layer))
            logger.warning(KEPT_IN_FLOAT32, layer.name)
        return layer.dtype_policy

    def _kept_for_uncast_consumers(self, layer, policy):
        """Return `policy`, or `layer`'s own where a Keras 2 op layer would fail."""
        consumers = _compat.uncast_consumers(layer)
        if not consumers:
            return policy
        if id(layer) not in self._kept_layers:
            self._kept_layers.add(id(layer))
            names = ", ".join(repr(consumer.name) for consumer in consumers)
            logger.warning(
                KEPT_FOR_UNCAST_CONSUMERS, layer.name, layer.compute_dtype, names
            )
        return layer.dtype_policy

    @staticmethod
    def _set_policy(layer, policy) -> bool:
        """Give `layer` `policy`; return True when its policy changed."""
        if layer.dtype_policy.name == policy.name:
            return False
        _compat.set_layer_policy(layer, policy)
        return True


def _decided_owners(model, decisions) -> dict:
    """Return `decisions` with each decided layer's policy owner decided alike.

    A layer computing under a wrapper's policy (`layer_names.policy_owners`)
    changes precision only through the wrapper's: the wrapper takes the
    wrapped layer's decision (the more specific one; a wrapper computes
    nothing of its own but reshapes).
    """
    decided = dict(decisions)
    for key, owners in layer_names.policy_owners(model).items():
        if key in decisions:
            for owner in owners:
                decided[id(owner)] = (owner, decisions[key][1])
    return decided


def _computing_policy(layer, owners):
    """Return the policy `layer` computes in: a 16-bit one if any use has one.

    `owners`: the layers whose policies it computes under
    (`layer_names.policy_owners`; none: its own).
    """
    policies = [owner.dtype_policy for owner in owners or (layer,)]
    low = [policy for policy in policies if policy.compute_dtype in _LOW_PRECISION]
    return (low or policies)[0]


def layer_precisions(model: keras.Model) -> list:
    """Return one dict per computing layer: name, name chain, path, class, dtypes.

    The name chain (`"backbone/hot"`) is what the lists and `AMPMonitor` name a
    layer by; every layer has one, where Keras's `path` is None for a layer
    without weights. Nested models are left out: their layers are listed, and
    a nested model's own policy computes nothing (nor is it saved with the
    model). A layer a wrapper runs under the wrapper's policy (Keras 3's
    `TimeDistributed`) reports the policy it computes in, the wrapper's.

    Args:
        model: a Keras model.
    """
    chains = layer_names.layer_chains(model)
    owners = layer_names.policy_owners(model)
    rows = []
    for layer in layer_names.candidate_layers(model):
        if isinstance(layer, keras.Model):
            continue
        policy = _computing_policy(layer, owners.get(id(layer), ()))
        rows.append(
            {
                "name": layer.name,
                "chain": chains[id(layer)],
                "path": _compat.layer_path(layer),
                "class_name": type(layer).__name__,
                "policy": policy.name,
                "compute_dtype": policy.compute_dtype,
                "variable_dtype": policy.variable_dtype,
                "low_precision": policy.compute_dtype in _LOW_PRECISION,
            }
        )
    return rows

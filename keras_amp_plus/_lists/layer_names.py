"""Resolve layer-list entries (names, paths, class names, regexes) to layers.

A layer is identified by its *name chain*: the names of the layers from the
model down to it, joined by "/" (`"backbone/hot"` for layer `hot` inside the
nested model `backbone`; the top model's own name is left out). Every layer has
one, with or without weights, and it survives nesting, a `Sequential` inside a
functional model and `keras.saving.load_model` (Keras's `layer.path` is None
for a layer without weights and loses the parent prefix after a reload).

An entry matches a layer when it equals the layer's name, name chain or Keras
path (exact), its class name, or when it is a regular expression that fully
matches one of those. A matched layer brings its nested layers with it (denying a nested
model denies everything inside it).

When a layer is matched by both lists, the most specific entry decides: an
exact name or path beats a class name, which beats a regular expression; on a
tie, deny wins. So `deny_layers=("LayerNormalization",)` with
`allow_layers=("encoder/ln_3",)` keeps every LayerNormalization in float32 but
`encoder/ln_3`.
"""

import difflib
import re

import keras

from keras_amp_plus import _compat

EXACT, CLASS_NAME, REGEX = 2, 1, 0


def candidate_layers(model) -> list:
    """Return the model's nested layers that compute something (no inputs)."""
    return [
        layer
        for layer in _compat.flatten_layers(model)
        if not isinstance(layer, keras.layers.InputLayer)
    ]


def layer_chains(model) -> dict:
    """Return `{id(layer): name chain}` for every layer nested in `model`.

    Args:
        model: a Keras model (or layer).

    Returns:
        The name chain of each nested layer, the first time it is reached in a
        depth-first walk from `model` (a layer shared by two parents keeps the
        first chain).

    Example:
    >>> import keras
    >>> inner = keras.Sequential([keras.layers.ReLU(name="act")], name="inner")
    >>> model = keras.Sequential([keras.Input((2,)), inner])
    >>> sorted(layer_chains(model).values())
    ['inner', 'inner/act']
    """
    chains = {}

    def walk(parent, prefix):
        for layer in _compat.direct_sublayers(parent):
            if id(layer) in chains or isinstance(layer, keras.layers.InputLayer):
                continue
            chain = f"{prefix}{layer.name}"
            chains[id(layer)] = chain
            walk(layer, chain + "/")

    walk(model, "")
    # Layers reached only through a non-tracked route keep their own name.
    for layer in candidate_layers(model):
        chains.setdefault(id(layer), layer.name)
    return chains


def policy_owners(model) -> dict:
    """Return `{id(layer): [owner, ...]}` for layers computing under another's policy.

    A layer a wrapper runs under the wrapper's own dtype policy (Keras 3's
    `TimeDistributed`, `_compat.computes_under_parent_policy`) computes in
    the policy of that wrapper, or of the wrapper's owner in turn: setting
    the wrapped layer's policy alone changes nothing there. Layers computing
    only under their own policy are absent.

    Args:
        model: a Keras model (or layer).

    Returns:
        The layers whose policies each such layer computes in: for each
        wrapper running it, the outermost layer whose policy applies; the
        layer itself too where it is also called on its own (shared).

    Example:
    >>> import keras
    >>> wrapper = keras.layers.TimeDistributed(keras.layers.Dense(2), name="td")
    >>> model = keras.Sequential([keras.Input((3, 4)), wrapper])
    >>> [[owner.name for owner in owners] for owners in policy_owners(model).values()]
    [['td']]
    """
    owners, walked, on_its_own = {}, set(), {}

    def walk(parent, parent_owner):
        # `parent_owner`: whose policy `parent` computes under (None: its own).
        for layer in _compat.direct_sublayers(parent):
            if isinstance(layer, keras.layers.InputLayer):
                continue
            owner = None  # a layer called through `__call__` computes its own
            if _compat.computes_under_parent_policy(layer, parent):
                owner = parent_owner or parent
                known = owners.setdefault(id(layer), [])
                if all(owner is not other for other in known):
                    known.append(owner)
            else:
                on_its_own[id(layer)] = layer
            # Walked again only under a new owner: its sublayers share it.
            key = (id(layer), id(owner))
            if key not in walked:
                walked.add(key)
                walk(layer, owner)

    walk(model, None)
    for key, known in owners.items():
        if key in on_its_own:
            known.append(on_its_own[key])
    return owners


def _identifiers(layer, chain=None) -> tuple:
    names = [layer.name]
    for alias in (chain, _compat.layer_path(layer)):
        if alias and alias not in names:
            names.append(alias)
    return tuple(names)


def match_specificity(entry: str, layer, chain: str | None = None):
    """Return how specifically `entry` names `layer` (EXACT > CLASS_NAME > REGEX).

    Args:
        entry: a layer-list entry.
        layer: a Keras layer.
        chain: the layer's name chain in the model. Defaults to `None`.

    Returns:
        `EXACT`, `CLASS_NAME` or `REGEX`, or None when the entry does not match.
    """
    identifiers = _identifiers(layer, chain)
    if entry in identifiers:
        return EXACT
    if entry == type(layer).__name__:
        return CLASS_NAME
    if any(re.fullmatch(entry, identifier) for identifier in identifiers):
        return REGEX
    return None


def _close_names(entry: str, layers, chains) -> list:
    names = set()
    for layer in layers:
        names.update(_identifiers(layer, chains.get(id(layer))))
        names.add(type(layer).__name__)
    return difflib.get_close_matches(entry, sorted(names), n=3, cutoff=0.5)


def matching_layers(model, entries, field: str) -> dict:
    """Map each entry to the layers it matches; raise when one matches nothing.

    Args:
        model: a Keras model.
        entries: layer-list entries.
        field: the `PrecisionLists` field they came from, for the message.

    Returns:
        `{entry: [layer, ...]}` in the order of `entries` (direct matches only,
        not their nested layers).
    """
    layers = candidate_layers(model)
    chains = layer_chains(model)
    result = {}
    for entry in entries:
        matched = [
            layer
            for layer in layers
            if match_specificity(entry, layer, chains.get(id(layer))) is not None
        ]
        if not matched:
            close = _close_names(entry, layers, chains)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise ValueError(
                f"`{field}` entry {entry!r} matches no layer of model "
                f"{model.name!r}. Entries are layer names, name chains from the "
                f"model down (e.g. 'backbone/dense'), layer paths, layer "
                f"class names or regular expressions that fully match a name or "
                f"a path.{hint} Received: {field}={tuple(entries)!r}"
            )
        result[entry] = matched
    return result


def layer_decisions(model, allow_layers, deny_layers) -> dict:
    """Decide, for every layer the lists reach, whether it is allowed or denied.

    Args:
        model: a Keras model.
        allow_layers: entries of the allow list.
        deny_layers: entries of the deny list.

    Returns:
        `{id(layer): (layer, "allow" | "deny")}` for every matched layer and
        every layer nested inside one; layers the lists do not reach are absent.
    """
    best = {}
    chains = layer_chains(model)
    for kind, entries, field in (
        ("allow", allow_layers, "allow_layers"),
        ("deny", deny_layers, "deny_layers"),
    ):
        for entry, layers in matching_layers(model, entries, field).items():
            for layer in layers:
                specificity = match_specificity(entry, layer, chains.get(id(layer)))
                key = (specificity, kind == "deny")
                for reached in [layer, *_compat.flatten_layers(layer)]:
                    previous = best.get(id(reached))
                    if previous is None or key > previous[0]:
                        best[id(reached)] = (key, reached, kind)
    return {key: (layer, kind) for key, (_, layer, kind) in best.items()}

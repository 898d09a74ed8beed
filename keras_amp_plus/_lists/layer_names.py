"""Resolve layer-list entries (names, paths, class names, regexes) to layers.

An entry matches a layer when it equals the layer's name or path (exact), its
class name, or when it is a regular expression that fully matches the name or
the path. A matched layer brings its nested layers with it (denying a nested
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


def _identifiers(layer) -> tuple:
    path = _compat.layer_path(layer)
    return (layer.name, path) if path else (layer.name,)


def match_specificity(entry: str, layer):
    """Return how specifically `entry` names `layer` (EXACT > CLASS_NAME > REGEX).

    Args:
        entry: a layer-list entry.
        layer: a Keras layer.

    Returns:
        `EXACT`, `CLASS_NAME` or `REGEX`, or None when the entry does not match.
    """
    identifiers = _identifiers(layer)
    if entry in identifiers:
        return EXACT
    if entry == type(layer).__name__:
        return CLASS_NAME
    if any(re.fullmatch(entry, identifier) for identifier in identifiers):
        return REGEX
    return None


def _close_names(entry: str, layers) -> list:
    names = set()
    for layer in layers:
        names.update(_identifiers(layer))
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
    result = {}
    for entry in entries:
        matched = [
            layer for layer in layers if match_specificity(entry, layer) is not None
        ]
        if not matched:
            close = _close_names(entry, layers)
            hint = f" Did you mean {', '.join(close)}?" if close else ""
            raise ValueError(
                f"`{field}` entry {entry!r} matches no layer of model "
                f"{model.name!r}. Entries are layer names, layer paths, layer "
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
    for kind, entries, field in (
        ("allow", allow_layers, "allow_layers"),
        ("deny", deny_layers, "deny_layers"),
    ):
        for entry, layers in matching_layers(model, entries, field).items():
            for layer in layers:
                key = (match_specificity(entry, layer), kind == "deny")
                for reached in [layer, *_compat.flatten_layers(layer)]:
                    previous = best.get(id(reached))
                    if previous is None or key > previous[0]:
                        best[id(reached)] = (key, reached, kind)
    return {key: (layer, kind) for key, (_, layer, kind) in best.items()}

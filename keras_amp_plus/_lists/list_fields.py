"""Op-level placements and the ADD/REMOVE list fields graph engines consume.

Grappler and ITEX read each list as "defaults + ADD - REMOVE", and both reject
(or silently skip the rewrite on) an op type that ends up in two lists. So every
ADD to one list is paired with a REMOVE from the three others:

    fields = base                       # what the user had set before
    for op, list in placements:
        add op to    <list>_add,   drop it from <list>_remove
        add op to    <other>_remove, drop it from <other>_add   (3 other lists)

Op types the placements do not mention keep the user's base setting.
"""

import warnings

from keras_amp_plus import _compat
from keras_amp_plus._lists import layer_names
from keras_amp_plus._lists.op_types import op_types_for_layer, own_op_types

LIST_NAMES = ("allow", "infer", "clear", "deny")
FIELD_NAMES = tuple(
    f"{name}list_{action}" for name in LIST_NAMES for action in ("add", "remove")
)


def split_op_types(value) -> list:
    """Return the op types of a comma-separated string (None or "" -> [])."""
    return [name.strip() for name in (value or "").split(",") if name.strip()]


def merge_list_fields(base, placements) -> dict:
    """Return the eight `<list>list_{add,remove}` fields for some placements.

    A pure function shared by the grappler engine (environment variables) and
    the ITEX engine (`AutoMixedPrecisionOptions` fields).

    Args:
        base: mapping from field name (`"denylist_add"`, ...) to the
            comma-separated op types already set; missing fields are empty.
        placements: mapping from op type to the list it must be in ("allow",
            "infer", "clear" or "deny").

    Returns:
        A dict with all eight field names, each a comma-separated string.

    Example:
    >>> fields = merge_list_fields({"denylist_add": "Pow"}, {"MatMul": "deny"})
    >>> fields["denylist_add"], fields["allowlist_remove"]
    ('Pow,MatMul', 'MatMul')
    """
    fields = {field: split_op_types(base.get(field)) for field in FIELD_NAMES}
    for op_type, target in placements.items():
        if target not in LIST_NAMES:
            raise ValueError(
                f"Op type {op_type!r} is placed in an unknown list. Expected one "
                f"of {list(LIST_NAMES)}. Received: {op_type}={target!r}"
            )
        for name in LIST_NAMES:
            keep, drop = ("add", "remove") if name == target else ("remove", "add")
            if op_type not in fields[f"{name}list_{keep}"]:
                fields[f"{name}list_{keep}"].append(op_type)
            if op_type in fields[f"{name}list_{drop}"]:
                fields[f"{name}list_{drop}"].remove(op_type)
    return {field: ",".join(names) for field, names in fields.items()}


def without_conflicts(fields) -> dict:
    """Pair every op type ADDed to a list with REMOVEs from the three others.

    `merge_list_fields` does this for the op types it places; this also covers
    op types the user's own variables or ITEX config ADD (the default lists
    could hold them elsewhere, and grappler and ITEX then skip the whole
    rewrite). An op type ADDed to two lists is an error: it would leave the
    whole graph float32.

    Example:
    >>> fields = without_conflicts({"denylist_add": "Pow"})
    >>> fields["allowlist_remove"], fields["inferlist_remove"]
    ('Pow', 'Pow')
    """
    names = {field: split_op_types(fields.get(field)) for field in FIELD_NAMES}
    added = {}
    for target in LIST_NAMES:
        for op_type in names[f"{target}list_add"]:
            if op_type in names[f"{target}list_remove"]:
                continue  # REMOVE wins over an ADD to the same list: in no list
            if op_type in added:
                raise ValueError(
                    f"Op type {op_type!r} is added to two lists ({added[op_type]} "
                    f"and {target}); the rewrite would then be skipped. Keep "
                    f"it in one list. Received: {added[op_type]}list_add and "
                    f"{target}list_add both hold {op_type!r}"
                )
            added[op_type] = target
    for op_type, target in added.items():
        for name in LIST_NAMES:
            removed = names[f"{name}list_remove"]
            if name == target and op_type in removed:
                removed.remove(op_type)
            elif name != target and op_type not in removed:
                removed.append(op_type)
    return {field: ",".join(values) for field, values in names.items()}


def _layer_placements(model, lists, decisions) -> dict:
    """Translate layer decisions to op types: deny wins over allow."""
    placements = {}
    entries = set(lists.allow_layers) | set(lists.deny_layers)
    for layer, kind in decisions.values():
        layer_op_types = op_types_for_layer(layer)
        # Only warn for layers named outright: a regex such as ".*" reaching
        # Flatten or Dropout is not a mistake.
        named = {layer.name, _compat.layer_path(layer), type(layer).__name__} & entries
        if named and not layer_op_types:
            warnings.warn(
                f"Layer {layer.name!r} ({type(layer).__name__}) has no op-type "
                "mapping, so a graph engine cannot place it in a list. List its "
                "op types in `allow_ops`/`deny_ops`, or use engine='keras'.",
                stacklevel=4,
            )
        for op_type in layer_op_types:
            if placements.get(op_type) != "deny":
                placements[op_type] = kind
    return placements


def _warn_of_denials_reaching_other_layers(model, lists, decisions, denied_ops):
    """Warn when a denied layer's op types also run layers not denied.

    A graph list holds op types, not layers: denying one Dense layer's
    MatMul denies every MatMul of the model, a quiet float32 run of layers
    the user never listed. `denied_ops` holds only op types denied because
    of layer entries (an op type in `deny_ops` is the user's own choice).
    """
    chains = layer_names.layer_chains(model)
    reached = {}
    for layer in layer_names.candidate_layers(model):
        decision = decisions.get(id(layer))
        if decision is not None and decision[1] == "deny":
            continue
        shared = [op for op in own_op_types(layer) if op in denied_ops]
        if shared:
            reached[chains.get(id(layer), layer.name)] = shared
    if not reached:
        return
    described = ", ".join(f"{name} ({', '.join(ops)})" for name, ops in reached.items())
    shared_ops = tuple(sorted({op for ops in reached.values() for op in ops}))
    warnings.warn(
        "A graph engine's lists hold op types, not layers: the layers of "
        "`deny_layers` deny their op types in every layer that runs them, so "
        f"these layers, not in `deny_layers`, run these ops in float32 too: "
        f"{described}. To keep only the listed layers in float32, use "
        "engine='keras' (dtype policies); to deny these op types on purpose, "
        f"list them in `deny_ops={shared_ops!r}`. "
        f"Received: deny_layers={lists.deny_layers!r}",
        stacklevel=4,
    )


LOW_PRECISION = ("float16", "bfloat16")


def _check_graph_lists_act(model, lists, decisions) -> None:
    """Raise where a graph engine's lists would silently change nothing.

    A graph rewrite lowers float32 ops into a 16-bit type; it cannot put an op
    back into float32 that a layer's dtype policy computes in float16 or
    bfloat16 (a `mixed_*` model's layers): a denial of such a layer, or op
    lists on a model whose every layer computes so, would do nothing.
    """
    chains = layer_names.layer_chains(model)
    low = [
        chains.get(id(layer), layer.name)
        for layer, kind in decisions.values()
        if kind == "deny" and layer.compute_dtype in LOW_PRECISION
    ]
    fix = (
        "Deny layers of a mixed-precision model with engine='keras' (their "
        "dtype policies), or build the model in float32 (the global policy "
        "'float32') for the graph rewrite to lower."
    )
    if low:
        raise ValueError(
            "A graph engine cannot put these layers back into float32: they "
            f"compute in a 16-bit type by their dtype policies: {low}. {fix} "
            f"Received: deny_layers={lists.deny_layers!r}"
        )
    op_entries = {f"{name}_ops": getattr(lists, f"{name}_ops") for name in LIST_NAMES}
    computing = [
        layer.compute_dtype
        for layer in layer_names.candidate_layers(model)
        if layer.weights or not _compat.direct_sublayers(layer)
    ]
    if (
        any(op_entries.values())
        and computing
        and all(dtype in LOW_PRECISION for dtype in computing)
    ):
        raise ValueError(
            "A graph engine's op lists would change nothing here: every layer "
            "of the model computes in a 16-bit type by its dtype policy, and the "
            f"graph rewrite only lowers float32 ops. {fix} Received: "
            + ", ".join(f"{k}={v!r}" for k, v in op_entries.items() if v)
        )


def op_placements(model, lists) -> dict:
    """Return `{op type: list name}` for a graph engine.

    Layer entries are translated with `op_types_for_layer` (when one op type
    comes from both an allowed and a denied layer, deny wins, because graph
    lists cannot tell two layers' MatMuls apart); explicit op entries then win
    over translated ones.

    Args:
        model: the Keras model the layer entries refer to.
        lists: a `PrecisionLists`.
    """
    decisions = layer_names.layer_decisions(
        model, lists.allow_layers, lists.deny_layers
    )
    _check_graph_lists_act(model, lists, decisions)
    placements = _layer_placements(model, lists, decisions)
    denied_by_layers = {op for op, kind in placements.items() if kind == "deny"}
    for name in LIST_NAMES:
        for op_type in getattr(lists, f"{name}_ops"):
            placements[op_type] = name
            denied_by_layers.discard(op_type)  # the user placed it outright
    if denied_by_layers:
        _warn_of_denials_reaching_other_layers(
            model, lists, decisions, denied_by_layers
        )
    return placements

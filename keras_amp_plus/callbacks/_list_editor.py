"""Carry out the adaptation rule's decisions on `PrecisionLists`, reversibly.

At layer level (the `keras` engine) a denied layer's path goes into
`deny_layers`. At op level (graph engines: `grappler`, `itex`) the layer is
translated to its op types with the engine's documented mapping
`engine.op_types_for_layer(layer)` and those op types move to `deny_ops`; note
that this keeps every layer using those op types in float32.

Moving a layer back puts its entries where they were before the monitor moved
them (the allow/infer/clear list, or no list for op types); a layer that was in
no list goes to the allow list, so that it runs in the mixed policy even when
its saved policy (after `load_model`) is float32. At op level an op type stays
denied while another monitor-denied layer still needs it.
"""

import copy

from keras_amp_plus._lists import layer_names


class ListEditor:
    """Apply deny/allow decisions to lists and remember how to undo them.

    Args:
        engine: the resolved engine (its `level` picks layers or op types).
        index: the model's `LayerIndex`.
    """

    def __init__(self, engine, index):
        self.engine = engine
        self.index = index
        self.origins = {}
        self.needs = {}

    def denied_layers(self, model, lists) -> set:
        """Return the name chains of the layers in float32 under `lists`."""
        decisions = layer_names.layer_decisions(
            model, lists.allow_layers, lists.deny_layers
        )
        denied = {
            self.index.chain(layer)
            for layer, kind in decisions.values()
            if kind == "deny"
        }
        return denied | set(self.origins)

    def apply(self, lists, decision):
        """Return `(new lists, [change dicts])` for one decision."""
        if decision.to == "deny":
            return self._deny(lists, decision.layer)
        return self._restore(lists, decision.layer)

    def _deny(self, lists, path):
        if self.engine.level == "layer":
            self.origins[path] = {path: lists.layer_list_of(path)}
            return lists.move_layers([path], "deny"), [
                _change("layer", path, self.origins[path][path], "deny", path)
            ]
        op_types = self.engine.op_types_for_layer(self.index.by_path[path])
        origin = {
            op: lists.op_list_of(op)
            for op in op_types
            if lists.op_list_of(op) != "deny"
        }
        self.origins[path] = origin
        self.needs[path] = list(op_types)
        if not origin:
            return lists, []
        changes = [
            _change("op", op, before, "deny", path) for op, before in origin.items()
        ]
        return lists.move_ops(list(origin), "deny"), changes

    def _restore(self, lists, path):
        origin = self.origins.pop(path, {})
        self.needs.pop(path, None)
        kind = "layer" if self.engine.level == "layer" else "op"
        changes = []
        for name, before in origin.items():
            keeper = next((o for o, ops in self.needs.items() if name in ops), None)
            if keeper is not None:
                # Another denied layer still needs it: that layer undoes it later.
                self.origins[keeper][name] = before
                continue
            if kind == "layer" and before is None:
                # Back to low precision explicitly: a layer in no list keeps the
                # policy it had when the engine first saw it, which after
                # `load_model` is the saved float32 one.
                before = "allow"
            lists = _move_to(lists, kind, name, before)
            changes.append(_change(kind, name, "deny", before, path))
        return lists, changes

    def get_state(self) -> dict:
        """Return what is needed to undo the moves, as JSON data."""
        # Copies: the monitor's state keeps them, and this editor goes on.
        return copy.deepcopy({"origins": self.origins, "needs": self.needs})

    def set_state(self, state: dict) -> None:
        """Restore `get_state()` output."""
        self.origins = {k: dict(v) for k, v in state.get("origins", {}).items()}
        self.needs = {k: list(v) for k, v in state.get("needs", {}).items()}


def _move_to(lists, kind, name, target):
    if target is not None:
        move = lists.move_layers if kind == "layer" else lists.move_ops
        return move([name], target)
    field = "deny_layers" if kind == "layer" else "deny_ops"
    return lists.replace(
        **{field: tuple(n for n in getattr(lists, field) if n != name)}
    )


def _change(kind, name, before, after, layer):
    return {"kind": kind, "name": name, "from": before, "to": after, "layer": layer}

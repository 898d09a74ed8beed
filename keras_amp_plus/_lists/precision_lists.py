"""`PrecisionLists`: which layers and op types run in low precision.

An immutable value (like jmp's `Policy`): every update returns a new object, so
a callback can keep the lists of each epoch and `diff` them.

Two levels, one object:

- layer level, `allow_layers` / `deny_layers`: layer names, layer paths, layer
  class names or regular expressions (full match on name or path). The `keras`
  engine turns them into per-layer dtype policies (deny -> float32, allow ->
  the mixed policy); graph engines translate them to op types
  (`keras_amp_plus._lists.op_types_for_layer`).
- op level, `allow_ops` / `infer_ops` / `clear_ops` / `deny_ops`: TensorFlow op
  types, the vocabulary of grappler's and ITEX's auto mixed precision. ALLOW is
  always low precision, INFER follows its inputs unless fed by a DENY op, CLEAR
  follows its neighbours, DENY stays float32.
"""

import dataclasses
import json
import os
import re
from collections.abc import Iterable, Mapping

from keras_amp_plus._lists import env_vars, layer_names, validation

LAYER_FIELDS = ("allow_layers", "deny_layers")
OP_FIELDS = ("allow_ops", "infer_ops", "clear_ops", "deny_ops")


def _code_span(text: str) -> str:
    """Return `text` as a markdown code span, whatever backticks it holds."""
    runs = re.findall("`+", text)
    # CommonMark: a longer fence than any backtick run inside, padded by spaces.
    fence = "`" * (max(map(len, runs), default=0) + 1)
    padded = f" {text} " if runs else text
    return f"{fence}{padded}{fence}"


@dataclasses.dataclass(frozen=True, eq=False)
class PrecisionLists:
    """Allow/deny lists for layers and op types, as an immutable value.

    Args:
        allow_layers: layers that run in the mixed (low-precision) policy.
            Defaults to `()`.
        deny_layers: layers kept in float32. Defaults to `()`.
        allow_ops: op types always converted to low precision. Defaults to `()`.
        infer_ops: op types converted unless fed by a denied op. Defaults to `()`.
        clear_ops: op types that follow their neighbours. Defaults to `()`.
        deny_ops: op types kept in float32. Defaults to `()`.

    Example:
    >>> from keras_amp_plus import PrecisionLists
    >>> lists = PrecisionLists(deny_layers=("LayerNormalization",))
    >>> lists = lists.move_ops(["Softmax"], to="deny")
    >>> lists.deny_ops
    ('Softmax',)
    >>> PrecisionLists.from_json(lists.to_json()) == lists
    True
    """

    allow_layers: tuple[str, ...] = ()
    deny_layers: tuple[str, ...] = ()
    allow_ops: tuple[str, ...] = ()
    infer_ops: tuple[str, ...] = ()
    clear_ops: tuple[str, ...] = ()
    deny_ops: tuple[str, ...] = ()

    def __post_init__(self):
        for field in LAYER_FIELDS + OP_FIELDS:
            names = validation.as_names(getattr(self, field), field)
            object.__setattr__(self, field, names)
        validation.check_lists(self, LAYER_FIELDS, OP_FIELDS)

    def _entry_sets(self) -> tuple:
        return tuple(frozenset(getattr(self, f)) for f in LAYER_FIELDS + OP_FIELDS)

    def __eq__(self, other):
        # The order of entries decides nothing: a layer or op type is in a
        # list or not.
        if not isinstance(other, PrecisionLists):
            return NotImplemented
        return self._entry_sets() == other._entry_sets()

    def __hash__(self):
        return hash(self._entry_sets())

    def replace(self, **changes) -> "PrecisionLists":
        """Return a copy with some fields replaced (validated like the original).

        Args:
            **changes: new values for fields, by field name.
        """
        unknown = sorted(set(changes) - set(LAYER_FIELDS + OP_FIELDS))
        if unknown:
            raise TypeError(
                f"Unknown `PrecisionLists` fields {unknown}; expected fields among "
                f"{list(LAYER_FIELDS + OP_FIELDS)}. Received: {changes!r}"
            )
        return dataclasses.replace(self, **changes)

    def _move(self, names, to: str, suffix: str, fields, argument: str):
        target = f"{to}_{suffix}"
        if target not in fields:
            choices = [field.split("_")[0] for field in fields]
            raise ValueError(f"`to` must be one of {choices}. Received: to={to!r}")
        names = validation.as_names(names, argument)
        changes = {
            field: tuple(n for n in getattr(self, field) if n not in names)
            for field in fields
        }
        changes[target] = changes[target] + names
        return self.replace(**changes)

    def move_layers(self, names: Iterable[str] | str, to: str) -> "PrecisionLists":
        """Return new lists with `names` in the `to` layer list.

        The names leave the other layer list; `self` is unchanged.

        Args:
            names: a layer entry or an iterable of them (names, paths, class
                names or regular expressions).
            to: "allow" or "deny".

        Example:
        >>> from keras_amp_plus import PrecisionLists
        >>> lists = PrecisionLists(allow_layers=("head",))
        >>> lists.move_layers("head", to="deny").deny_layers
        ('head',)
        """
        return self._move(names, to, "layers", LAYER_FIELDS, "names")

    def move_ops(self, op_types: Iterable[str] | str, to: str) -> "PrecisionLists":
        """Return new lists with `op_types` in the `to` op list.

        The op types leave every other op list; `self` is unchanged.

        Args:
            op_types: a TF op type or an iterable of them.
            to: "allow", "infer", "clear" or "deny".
        """
        return self._move(op_types, to, "ops", OP_FIELDS, "op_types")

    def layer_list_of(self, name: str) -> str | None:
        """Return "allow", "deny" or None: the layer list holding `name`."""
        for field in LAYER_FIELDS:
            if name in getattr(self, field):
                return field.split("_")[0]
        return None

    def op_list_of(self, op_type: str) -> str | None:
        """Return "allow", "infer", "clear", "deny" or None for `op_type`."""
        for field in OP_FIELDS:
            if op_type in getattr(self, field):
                return field.split("_")[0]
        return None

    def matching_layers(self, model) -> dict[str, list]:
        """Resolve every layer entry to the model's layers it matches.

        Raises ValueError, naming close layer names, for an entry that matches
        no layer.

        Args:
            model: the Keras model the entries refer to.

        Returns:
            `{entry: [layer, ...]}` for the allow then the deny entries.
        """
        result = {}
        for field in LAYER_FIELDS:
            entries = getattr(self, field)
            result.update(layer_names.matching_layers(model, entries, field))
        return result

    def diff(self, other: "PrecisionLists") -> list[dict]:
        """List the moves that turn `self` into `other`.

        Args:
            other: the later `PrecisionLists`.

        Returns:
            `[{"kind": "layer" | "op", "name", "from", "to"}]`, where "from" and
            "to" are list names ("allow", "deny", ...) or None (in no list).
        """
        changes = []
        for kind, fields, list_of in (
            ("layer", LAYER_FIELDS, "layer_list_of"),
            ("op", OP_FIELDS, "op_list_of"),
        ):
            names = [n for f in fields for s in (self, other) for n in getattr(s, f)]
            for name in dict.fromkeys(names):
                before = getattr(self, list_of)(name)
                after = getattr(other, list_of)(name)
                if before != after:
                    changes.append(
                        {"kind": kind, "name": name, "from": before, "to": after}
                    )
        return changes

    def to_markdown(self) -> str:
        """Return the lists as a markdown table (for TensorBoard text)."""
        rows = ["| list | entries |", "| --- | --- |"]
        for field in LAYER_FIELDS + OP_FIELDS:
            # A regex alternation ("a|b") would end the table cell early.
            entries = ", ".join(
                _code_span(name).replace("|", "\\|") for name in getattr(self, field)
            )
            entries = entries or "-"
            rows.append(f"| {field} | {entries} |")
        return "\n".join(rows)

    def get_config(self) -> dict:
        """Return the lists as a JSON-friendly dict of lists."""
        return {field: list(getattr(self, field)) for field in LAYER_FIELDS + OP_FIELDS}

    @classmethod
    def from_config(cls, config: Mapping) -> "PrecisionLists":
        """Rebuild lists from `get_config()`; unknown keys raise ValueError.

        Args:
            config: a dict as returned by `get_config()`.
        """
        if not isinstance(config, Mapping):
            raise TypeError(
                "`PrecisionLists.from_config` takes a dict as `get_config()` "
                "returns it, e.g. {'deny_layers': ['head']}. Received: "
                f"config={config!r} of type {type(config).__name__}"
            )
        unknown = sorted(set(config) - set(LAYER_FIELDS + OP_FIELDS))
        if unknown:
            raise ValueError(
                f"Unknown `PrecisionLists` config keys {unknown}; expected keys "
                f"among {list(LAYER_FIELDS + OP_FIELDS)}. Received: config={config!r}"
            )
        return cls(**config)

    def to_json(self) -> str:
        """Return `get_config()` as a JSON string."""
        return json.dumps(self.get_config(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "PrecisionLists":
        """Rebuild lists from `to_json()`.

        Args:
            text: a JSON string as returned by `to_json()`.
        """
        try:
            config = json.loads(text)
        except (TypeError, ValueError) as error:
            raise ValueError(
                "`PrecisionLists.from_json` expects the JSON text `to_json()` "
                f'returns, e.g. \'{{"deny_layers": ["head"]}}\' ({error}). '
                f"Received: text={text!r}"
            ) from None
        return cls.from_config(config)

    @classmethod
    def from_env(cls, environ: Mapping | None = None) -> "PrecisionLists":
        """Read the op lists users already set for grappler or ITEX.

        An op type in `TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_<LIST>_ADD` or
        `ITEX_AUTO_MIXED_PRECISION_<LIST>_ADD` (`<LIST>` one of ALLOWLIST,
        INFERLIST, CLEARLIST, DENYLIST; comma-separated op types) goes to that
        op list, unless the matching `_REMOVE` variable takes it out again. A
        `_REMOVE` entry with no ADD to another list puts the op type in no list,
        which `PrecisionLists` cannot hold: it is not in the result (nor in its
        JSON), a UserWarning names it, and the graph engines still honour the
        variable since they start from the environment they find.

        Args:
            environ: mapping to read instead of `os.environ`. Defaults to None.

        Returns:
            A `PrecisionLists` with op lists only.

        Example:
        >>> from keras_amp_plus import PrecisionLists
        >>> env = {"TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_DENYLIST_ADD": "Mean"}
        >>> PrecisionLists.from_env(env).deny_ops
        ('Mean',)
        """
        environ = os.environ if environ is None else environ
        placed, read, unrepresented = env_vars.read_env_lists(environ)
        env_vars.warn_unrepresented(unrepresented)
        try:
            return cls(**{f"{name}_ops": ops for name, ops in placed.items()})
        except ValueError as error:
            raise ValueError(
                f"The mixed-precision list variables in the environment are "
                f"inconsistent: {error} Fix or unset them. The variables read: "
                f"{read}"
            ) from None


def as_precision_lists(lists, argument: str = "lists") -> PrecisionLists:
    """Return `lists` as `PrecisionLists`: given as one, its config dict, or None.

    Args:
        lists: a `PrecisionLists`, a dict as `get_config()` returns, or None
            (empty lists).
        argument: the argument's name, for the error. Defaults to `"lists"`.

    Example:
    >>> as_precision_lists({"deny_layers": ["head"]}).deny_layers
    ('head',)
    """
    if lists is None:
        return PrecisionLists()
    if isinstance(lists, PrecisionLists):
        return lists
    if isinstance(lists, Mapping):
        return PrecisionLists.from_config(dict(lists))
    raise TypeError(
        f"`{argument}` must be a `keras_amp_plus.PrecisionLists`, its config "
        f"dict, or None. Received: {argument}={lists!r}"
    )

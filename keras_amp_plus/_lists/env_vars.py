"""The op lists a user already set in the environment (`PrecisionLists.from_env`).

Grappler reads `TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_<LIST>_{ADD,REMOVE}` and
ITEX reads `ITEX_AUTO_MIXED_PRECISION_<LIST>_{ADD,REMOVE}`, `<LIST>` one of
ALLOWLIST, INFERLIST, CLEARLIST, DENYLIST. Each list is "defaults + ADD -
REMOVE": a REMOVE wins over an ADD to the same list.

- An op type ADDed to a list (and not REMOVEd from it) is placed in that list.
- A REMOVE paired with an ADD to another list is a move; the ADD says it all.
- A REMOVE with no such ADD takes the op type out of its default list into no
  list at all (never converted, but unlike DENY it does not taint its
  neighbours). `PrecisionLists` has no "no list", so such entries are reported
  as unrepresented, and `from_env` warns instead of dropping them silently.
"""

import warnings

from keras_amp_plus._lists.list_fields import FIELD_NAMES, LIST_NAMES, split_op_types

ENV_PREFIXES = (
    "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_",
    "ITEX_AUTO_MIXED_PRECISION_",
)


def _read_family(prefix: str, environ, read: dict) -> dict:
    fields = {}
    for field in FIELD_NAMES:
        variable = prefix + field.upper()
        value = environ.get(variable, "")
        if value:
            read[variable] = value
        fields[field] = split_op_types(value)
    return fields


def read_env_lists(environ) -> tuple:
    """Read every list variable of grappler and ITEX.

    Args:
        environ: the mapping to read (`os.environ` or a test's dict).

    Returns:
        `(placed, read, unrepresented)`: `placed` maps "allow", "infer",
        "clear", "deny" to the op types ADDed to that list; `read` maps every
        non-empty variable to its value; `unrepresented` maps a `*_REMOVE`
        variable to the op types it takes out of their list without an ADD
        elsewhere (in the same family of variables).

    Example:
    >>> placed, read, lost = read_env_lists(
    ...     {
    ...         "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_DENYLIST_ADD": "Mean",
    ...         "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_INFERLIST_REMOVE": "Mean,Tanh",
    ...     }
    ... )
    >>> placed["deny"], lost
    (['Mean'], {'TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_INFERLIST_REMOVE': ['Tanh']})
    """
    placed = {name: [] for name in LIST_NAMES}
    read, unrepresented = {}, {}
    for prefix in ENV_PREFIXES:
        fields = _read_family(prefix, environ, read)
        added = set()
        for name in LIST_NAMES:
            removed = fields[f"{name}list_remove"]
            for op_type in fields[f"{name}list_add"]:
                if op_type not in removed:
                    placed[name].append(op_type)
                    added.add(op_type)
        for name in LIST_NAMES:
            removed = fields[f"{name}list_remove"]
            lost = [op_type for op_type in removed if op_type not in added]
            if lost:
                unrepresented[f"{prefix}{name.upper()}LIST_REMOVE"] = lost
    return placed, read, unrepresented


def warn_unrepresented(unrepresented: dict) -> None:
    """Warn that some `*_REMOVE` entries have no place in `PrecisionLists`.

    Args:
        unrepresented: the third value returned by `read_env_lists`.
    """
    if unrepresented:
        warnings.warn(
            "Some mixed-precision `*_REMOVE` variables take op types out of "
            "their default list without adding them to another one. "
            "`PrecisionLists` has no 'in no list' entry, so the returned lists "
            "(and their JSON) do not carry these settings; the grappler and "
            "itex engines still honour the variables. To keep them explicitly, "
            "put the op types in a list (e.g. `lists.move_ops(op_types, "
            f"to='deny')`). Received: {unrepresented}",
            stacklevel=3,
        )

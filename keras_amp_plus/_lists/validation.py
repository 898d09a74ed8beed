"""Validation of `PrecisionLists` fields (see `keras_amp_plus._lists.precision_lists`).

Every check raises before an object exists, with the Keras-style message: what
is wrong, what was expected, how to fix it, and `Received: field=value`.
"""

import re
from collections.abc import Iterable, Mapping

from keras_amp_plus._lists import op_types


def as_names(value, field: str) -> tuple:
    """Normalize a str or an iterable of str to a tuple without duplicates."""
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Iterable) or isinstance(value, Mapping):
        raise TypeError(
            f"`{field}` must be a tuple of strings (layer names or op types), or "
            f"one string. Pass e.g. {field}=('name',). Received: {field}={value!r}"
        )
    names = []
    for name in value:
        if not isinstance(name, str) or not name.strip():
            raise TypeError(
                f"`{field}` must hold non-empty strings. Received: {field}={value!r}"
            )
        names.append(name.strip())
    return tuple(dict.fromkeys(names))


def _check_disjoint(lists, fields) -> None:
    """Raise ValueError when a name sits in two lists of the same level."""
    seen = {}
    for field in fields:
        for name in getattr(lists, field):
            if name in seen:
                raise ValueError(
                    f"{name!r} is in both `{seen[name]}` and `{field}`; a name "
                    "can be in one list only. Use `move_layers` / `move_ops` to "
                    f"move it. Received: {seen[name]}="
                    f"{getattr(lists, seen[name])!r}, {field}="
                    f"{getattr(lists, field)!r}"
                )
            seen[name] = field


def _check_regexes(entries, field: str) -> None:
    for entry in entries:
        try:
            re.compile(entry)
        except re.error as error:
            raise ValueError(
                f"`{field}` entry {entry!r} is not a valid regular expression "
                f"({error}). Layer entries are names, paths, class names or "
                "regular expressions; escape special characters with "
                f"`re.escape`. Received: {field}={entries!r}"
            ) from None


def check_lists(lists, layer_fields, op_fields) -> None:
    """Run every check on a `PrecisionLists` whose fields are normalized.

    Args:
        lists: the `PrecisionLists` being built.
        layer_fields: names of its layer-list fields.
        op_fields: names of its op-list fields.
    """
    _check_disjoint(lists, layer_fields)
    _check_disjoint(lists, op_fields)
    for field in layer_fields:
        _check_regexes(getattr(lists, field), field)
    for field in op_fields:
        op_types.check_op_types(getattr(lists, field), field)

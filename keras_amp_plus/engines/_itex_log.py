"""Read ITEX's auto-mixed-precision dumps: what was converted, which lists ran.

With `ITEX_AUTO_MIXED_PRECISION_LOG_PATH=<dir>` set (an existing directory),
each time ITEX's pass rewrites a graph it writes `graphdef_preop_<id>.pb` (the
graph it was given), `graphdef_AutoMixedPrecision_<id>.pb` (the result) and
`paintbuckets_AutoMixedPrecision_<id>.txt` (the final allow/deny/infer/clear
lists). A node is "converted" when its type attribute `T` is float32 before
and bfloat16/float16 after. When the lists are inconsistent (an op type in two
of them) the pass fails before it dumps anything, logging "Op lists have
conflicting entries", and the graph stays float32: then no new dump appears.
"""

import collections
import glob
import os
import re

import tensorflow as tf

LOG_PATH_ENV = "ITEX_AUTO_MIXED_PRECISION_LOG_PATH"
_LOW_PRECISION = {tf.bfloat16.as_datatype_enum, tf.float16.as_datatype_enum}
_FLOAT32 = tf.float32.as_datatype_enum
_LIST_HEADERS = {
    "AllowList": "allow",
    "DenyList": "deny",
    "InferList": "infer",
    "ClearList": "clear",
}


def _dump_ids(log_dir: str) -> list:
    """Return the ids of the rewrites dumped in `log_dir`, oldest first."""
    pattern = os.path.join(log_dir, "graphdef_AutoMixedPrecision_*.pb")
    names = (os.path.basename(path) for path in glob.glob(pattern))
    ids = (re.fullmatch(r"graphdef_AutoMixedPrecision_(\d+)\.pb", n) for n in names)
    return sorted(match.group(1) for match in ids if match)


def _type_attributes(path: str) -> dict:
    """Return `{node name: (op type, T enum or None)}` of a dumped GraphDef."""
    graph = tf.compat.v1.GraphDef()
    with open(path, "rb") as f:
        graph.ParseFromString(f.read())
    nodes = list(graph.node)
    for function in graph.library.function:
        nodes.extend(function.node_def)
    return {
        node.name: (node.op, node.attr["T"].type if "T" in node.attr else None)
        for node in nodes
    }


def converted_ops(log_dir: str, dump_id: str) -> collections.Counter:
    """Return `Counter({op type: nodes converted float32 -> low precision})`."""
    before = _type_attributes(os.path.join(log_dir, f"graphdef_preop_{dump_id}.pb"))
    after = _type_attributes(
        os.path.join(log_dir, f"graphdef_AutoMixedPrecision_{dump_id}.pb")
    )
    counts = collections.Counter()
    for name, (op_type, dtype) in after.items():
        if dtype in _LOW_PRECISION and before.get(name, (None, None))[1] == _FLOAT32:
            counts[op_type] += 1
    return counts


def parse_paintbuckets(text: str) -> dict:
    r"""Return `{"allow": set, "infer": set, "clear": set, "deny": set}`.

    Example:
    >>> lists = parse_paintbuckets("AllowList:\nMatMul\n\nDenyList:\nExp\n")
    >>> sorted(lists["allow"]), sorted(lists["deny"])
    (['MatMul'], ['Exp'])
    """
    lists = {name: set() for name in _LIST_HEADERS.values()}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if line.endswith(":") and line[:-1] in _LIST_HEADERS:
            current = _LIST_HEADERS[line[:-1]]
        elif line and current is not None:
            lists[current].add(line)
    return lists


def conflicting_ops(lists: dict) -> dict:
    """Return `{op type: [list names]}` for op types in more than one list."""
    where = collections.defaultdict(list)
    for name, op_types in lists.items():
        for op_type in op_types:
            where[op_type].append(name)
    return {op: sorted(names) for op, names in where.items() if len(names) > 1}


def read_rewrites(log_dir: str, since: int = 0) -> list:
    """Return one record per rewrite dumped in `log_dir`, after the first `since`.

    Args:
        log_dir: the directory `ITEX_AUTO_MIXED_PRECISION_LOG_PATH` names.
        since: how many rewrites to skip (a count returned by `count_rewrites`
            earlier). Defaults to `0`.

    Returns:
        A list of dicts, oldest first: `id`, `converted` (a Counter by op type)
        and `lists` (the final lists, `parse_paintbuckets`).
    """
    records = []
    for dump_id in _dump_ids(log_dir)[since:]:
        name = f"paintbuckets_AutoMixedPrecision_{dump_id}.txt"
        buckets = os.path.join(log_dir, name)
        lists = {}
        if os.path.exists(buckets):
            with open(buckets) as f:
                lists = parse_paintbuckets(f.read())
        converted = converted_ops(log_dir, dump_id)
        records.append({"id": dump_id, "converted": converted, "lists": lists})
    return records


def count_rewrites(log_dir: str) -> int:
    """Return how many rewrites `log_dir` holds."""
    return len(_dump_ids(log_dir))

"""`precision_report`: what actually runs in low precision.

Layer level (every engine): each layer's dtype policy and compute dtype.

Op level (graph engines): grappler writes, per optimized function,
`graphdef_preop_<function>_<stamp>.pb` (before) and
`graphdef_AutoMixedPrecision_<function>_<stamp>.pb` (after the rewrite; absent
when nothing was converted; ITEX names them `graphdef_<stage>_<id>.pb`, and
the report names such a graph "graph <id>") into
`*_AUTO_MIXED_PRECISION_*_LOG_PATH`, plus `paintbuckets_*.txt` (the final
lists). A node counts as converted when its
`T`/`dtype` attribute is bfloat16 (or float16) after the rewrite but was not
before; Cast nodes the rewrite inserted (named `...-CastToBf16-...
-AutoMixedPrecision`) are counted apart. A function with a `preop` dump and no
rewritten one was optimized and converted nothing: it is reported with zero
converted nodes (not left out, which would hide a train function whose lists
now deny everything behind "no train function seen").
"""

import collections
import glob
import os
import re

import keras
import tensorflow as tf

from keras_amp_plus._arguments import require_model
from keras_amp_plus.engines._base import Engine, last_engine
from keras_amp_plus.engines._grappler import LOG_PATH_VARIABLE
from keras_amp_plus.engines._itex import require_itex
from keras_amp_plus.engines._keras_engine import layer_precisions
from keras_amp_plus.engines._resolve import (
    auto_engine_name,
    check_engine_name,
    graph_rewrite_switched_on,
)

ITEX_LOG_PATH_VARIABLE = "ITEX_AUTO_MIXED_PRECISION_LOG_PATH"
# ITEX's pass names its dumps without the function: `graphdef_<stage>_<id>.pb`.
_DUMP_NAME = re.compile(
    r"graphdef_(?P<stage>AutoMixedPrecision|preop)_(?:(?P<function>.+)_)?"
    r"(?P<stamp>\d+)\.pb"
)
_LOW_PRECISION = {tf.bfloat16.as_datatype_enum, tf.float16.as_datatype_enum}
_TYPE_ATTRIBUTES = ("T", "dtype")


def _read_graph(path: str):
    graph = tf.compat.v1.GraphDef()
    with open(path, "rb") as file:
        graph.ParseFromString(file.read())
    return graph


def _is_low_precision(node) -> bool:
    for name in _TYPE_ATTRIBUTES:
        if name in node.attr:
            value = node.attr[name]
            if value.type in _LOW_PRECISION or _LOW_PRECISION & set(value.list.type):
                return True
    return False


def _read_paint_buckets(path: str) -> dict:
    buckets, current = {}, None
    with open(path) as file:
        for line in file:
            line = line.strip()
            if line.endswith("List:"):
                current = buckets.setdefault(line[: -len("List:")].lower(), [])
            elif line and current is not None:
                current.append(line)
    return buckets


def _inserted_cast(node) -> bool:
    return node.op == "Cast" and node.name.endswith("AutoMixedPrecision")


def _record(
    path: str, graph, converted, casts_inserted: int, lists, second_pass=False
) -> dict:
    match = _DUMP_NAME.fullmatch(os.path.basename(path))
    return {
        "function": match["function"] or f"graph {match['stamp']}",
        "file": path,
        "stamp": int(match["stamp"]),
        "is_train": any("gradient_tape/" in node.name for node in graph.node),
        "num_nodes": len(graph.node),
        "num_converted": sum(converted.values()),
        "converted_by_op": dict(sorted(converted.items())),
        "num_casts_inserted": casts_inserted,
        "lists": lists,
        "second_pass": second_pass,
    }


def summarize_dump(path: str) -> dict:
    """Count what one optimized function's rewrite converted.

    Args:
        path: a `graphdef_AutoMixedPrecision_*.pb` file, or a
            `graphdef_preop_*.pb` file the rewrite wrote alone (then nothing
            was converted).

    Returns:
        `{"function", "file", "stamp", "is_train", "num_nodes",
        "num_converted", "converted_by_op", "num_casts_inserted", "lists",
        "second_pass"}`; `stamp` orders the dumps in time, `lists` is the
        final ALLOW/INFER/CLEAR/DENY lists from `paintbuckets_*.txt` (empty
        when absent), `second_pass` is True for a pass over a graph the
        rewrite already rewrote (ITEX's pass runs in every round of
        grappler's: it converts nothing new).
    """
    directory, name = os.path.split(path)
    after = _read_graph(path)
    if _DUMP_NAME.fullmatch(name)["stage"] == "preop":
        return _record(path, after, collections.Counter(), 0, {})
    preop = os.path.join(directory, name.replace("_AutoMixedPrecision_", "_preop_"))
    before = _read_graph(preop).node if os.path.exists(preop) else []
    already_low = {node.name for node in before if _is_low_precision(node)}
    # ITEX's pass runs again on a graph it rewrote (grappler's next round):
    # that second dump converts nothing new.
    second_pass = any(_inserted_cast(node) for node in before)
    converted, casts_inserted = collections.Counter(), 0
    for node in after.node:
        if _inserted_cast(node):
            casts_inserted += 1
        elif _is_low_precision(node) and node.name not in already_low:
            converted[node.op] += 1
    buckets = os.path.join(directory, "paintbuckets" + name[len("graphdef") : -3])
    lists = {}
    if os.path.exists(buckets + ".txt"):
        lists = _read_paint_buckets(buckets + ".txt")
    return _record(path, after, converted, casts_inserted, lists, second_pass)


def read_rewrite_dump(dump_dir: str) -> dict:
    """Summarize every function the rewrite optimized in a graph-dump directory.

    Args:
        dump_dir: the directory `*_LOG_PATH` pointed at.

    Returns:
        `{"dump_dir", "functions": [...], "train": <the latest train function
        (not a second pass) or None>}`, functions in the order they were
        optimized, each as returned by `summarize_dump` (zero converted
        nodes when the rewrite wrote only the graph before it).
    """
    if not os.path.isdir(dump_dir):
        # Grappler does not create the directory: nothing was or will be dumped.
        raise ValueError(
            f"The graph-dump directory {dump_dir!r} does not exist, so there is "
            "no rewrite to report. Pass the directory `*_LOG_PATH` pointed at "
            "while the model ran (or the engine that trained it). "
            f"Received: dump_dir={dump_dir!r}"
        )
    escaped = glob.escape(dump_dir)
    rewritten = glob.glob(os.path.join(escaped, "graphdef_AutoMixedPrecision_*.pb"))
    done = {
        os.path.basename(p).replace("_AutoMixedPrecision_", "_preop_")
        for p in rewritten
    }
    untouched = [
        path
        for path in glob.glob(os.path.join(escaped, "graphdef_preop_*.pb"))
        if os.path.basename(path) not in done
    ]
    functions = sorted(
        (summarize_dump(path) for path in rewritten + untouched),
        key=lambda record: record["stamp"],
    )
    trains = [r for r in functions if r["is_train"] and not r["second_pass"]]
    return {
        "dump_dir": dump_dir,
        "functions": functions,
        "train": trains[-1] if trains else None,
    }


def _engine_name(model, engine) -> str:
    check_engine_name(engine, allow_none=True)
    if isinstance(engine, Engine):
        return engine.name
    if engine is None:
        return graph_rewrite_switched_on() or "keras"
    return auto_engine_name(model) if engine == "auto" else engine


def _dump_dir(name: str, engine, log_dir):
    if log_dir is not None:
        return log_dir
    if getattr(engine, "dump_dir", None):
        return engine.dump_dir
    variable = ITEX_LOG_PATH_VARIABLE if name == "itex" else LOG_PATH_VARIABLE
    if os.environ.get(variable):
        return os.environ[variable]
    if name == "itex":
        # ITEX dumps its rewrite only into the directory this variable names
        # while the model trains; its engine keeps no directory of its own.
        fix = (
            f"ITEX dumps its rewrite only where `{variable}` names an existing "
            "directory while the model trains: set it before training, then "
            "pass that directory as `log_dir=` or keep the variable set"
        )
    else:
        fix = (
            "Pass the engine object that trained the model, `log_dir=`, or set "
            f"`{variable}` before training"
        )
    raise ValueError(
        f"The {name!r} engine's report reads the rewrite's graph dump, but no "
        f"dump directory is known. {fix}. Received: engine={engine!r}, "
        "log_dir=None"
    )


def _table(header: tuple, rows: list, markdown: bool) -> list:
    """Return the lines of a plain-text (aligned) or Markdown table."""
    cells = [[str(cell) for cell in row] for row in (header, *rows)]
    if markdown:
        lines = ["| " + " | ".join(row) + " |" for row in cells]
        lines.insert(1, "|" + "---|" * len(header))
        return lines
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    padded = [
        [cell.ljust(width) for cell, width in zip(row, widths, strict=True)]
        for row in cells
    ]
    return ["  ".join(row).rstrip() for row in padded]


class PrecisionReport(dict):
    """The dict `precision_report` returns, printable as a table.

    `str(report)` is an aligned text table, `report.to_markdown()` the same in
    Markdown: a headline, one row per layer, and for graph engines what the
    rewrite converted in the latest train function, by op type.
    """

    def _lines(self, markdown: bool) -> list:
        headline = (
            f"Precision report of model {self['model']!r} (engine "
            f"{self['engine']!r}): {self['num_low_precision_layers']} of "
            f"{self['num_layers']} layers in low precision"
        )
        if self["jit_compile"] and self["engine"] != "keras":
            headline += " (XLA-compiled: graph rewrites do not apply)"
        header = ("layer", "class", "policy", "compute", "variables")
        rows = [
            tuple(row[key] for key in ("chain", "class_name", "policy"))
            + tuple(row[key] for key in ("compute_dtype", "variable_dtype"))
            for row in self["layers"]
        ]
        lines = [headline, *_table(header, rows, markdown)]
        train = self.get("graph", {}).get("train")
        if "graph" in self and train is None:
            lines += ["", "No train function was optimized by the rewrite yet."]
        elif train is not None:
            lines += [
                "",
                f"Train function {train['function']!r}: "
                f"{train['num_converted']} of {train['num_nodes']} nodes "
                f"converted, {train['num_casts_inserted']} casts inserted",
            ]
            converted = sorted(train["converted_by_op"].items())
            lines += _table(("op type", "converted"), converted, markdown)
        return lines

    def __str__(self) -> str:
        return "\n".join(self._lines(markdown=False))

    def to_markdown(self) -> str:
        """Return the report as Markdown (a headline and tables)."""
        return "\n".join(self._lines(markdown=True))


def precision_report(
    model: keras.Model,
    engine: str | Engine | None = None,
    log_dir: str | None = None,
) -> dict:
    """Report what runs in low precision for `model`.

    Args:
        model: a Keras model.
        engine: an Engine (its `dump_dir` is read), an engine name, or None:
            the engine that last took effect on `model` (an `AMPMonitor`'s,
            also after training, so the report describes the last epoch),
            else "grappler" when its rewrite is switched on, else "keras".
            Defaults to None.
        log_dir: graph-dump directory to read for graph engines. Defaults to
            None (the engine's `dump_dir`, else the `*_LOG_PATH` variable).

    Returns:
        A `PrecisionReport`: a dict `{"engine", "model", "layers": [...],
        "num_layers", "num_low_precision_layers", "jit_compile"}` plus, for
        graph engines, `"graph"` as returned by `read_rewrite_dump`. `print()`
        it for a table; `to_markdown()` gives the same as Markdown.

    Example:
    >>> import keras
    >>> from keras_amp_plus import precision_report
    >>> model = keras.Sequential(
    ...     [keras.Input((4,)), keras.layers.Dense(2, name="out")], name="m"
    ... )
    >>> report = precision_report(model, "keras")
    >>> report["num_low_precision_layers"]
    0
    >>> print(report)
    Precision report of model 'm' (engine 'keras'): 0 of 1 layers in low precision
    layer  class  policy   compute  variables
    out    Dense  float32  float32  float32
    """
    require_model(model, "precision_report")
    if engine is None:
        engine = last_engine(model)
    name = _engine_name(model, engine)
    if name == "itex" and log_dir is None and not isinstance(engine, Engine):
        require_itex()  # says ITEX is missing, not that no dump is known
    layers = layer_precisions(model)
    report = PrecisionReport(
        {
            "engine": name,
            "model": model.name,
            "layers": layers,
            "num_layers": len(layers),
            "num_low_precision_layers": sum(row["low_precision"] for row in layers),
            "jit_compile": bool(getattr(model, "jit_compile", False)),
        }
    )
    if name != "keras":
        report["graph"] = read_rewrite_dump(_dump_dir(name, engine, log_dir))
    return report

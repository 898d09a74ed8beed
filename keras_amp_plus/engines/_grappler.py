"""The `grappler` engine: op lists through stock TensorFlow's bf16 rewrite.

Turns on `auto_mixed_precision_onednn_bfloat16` and writes the lists into
`TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_{ALLOW,INFER,CLEAR,DENY}LIST_{ADD,REMOVE}`
(each ADD paired with REMOVEs from the other lists, starting from whatever the
user had set). Grappler re-reads these variables each time it optimizes a
function, so after a change the model's functions are rebuilt.

Each `apply` that rebuilds also points
`TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_LOG_PATH` at a fresh directory
(`dump_dir`), where grappler writes the graphs before and after the rewrite;
`keras_amp_plus.precision_report` counts the converted nodes there.
Grappler writes four files per optimized function (a train function's can be
megabytes), so a temporary directory the engine made keeps the last few
applies only and is deleted with the engine.

The option and the variables are process-global: `restore()` puts back exactly
what was there before the first `apply` (unset variables are unset again).
Engines applied at the same time (two models, each with its own) stack
(`GlobalStateStack`): the lists in force are those of the engine that applied
last, each merged with the user's own variables, and once every engine is
restored, in any order, the process is as before the first (until then the
rewrite, a process-global switch, stays on for every model).
"""

import os
import re
import shutil
import tempfile
import warnings
import weakref

import keras
import tensorflow as tf

from keras_amp_plus import _compat
from keras_amp_plus._arguments import require_model, require_path
from keras_amp_plus._lists.list_fields import (
    FIELD_NAMES,
    merge_list_fields,
    op_placements,
    split_op_types,
    without_conflicts,
)
from keras_amp_plus._lists.op_types import check_op_types
from keras_amp_plus._lists.precision_lists import PrecisionLists, as_precision_lists
from keras_amp_plus.engines._base import (
    Engine,
    GlobalStateStack,
    RebuildRecord,
    rebuild_functions,
    remember_engine,
    warn_if_xla,
)

ENV_PREFIX = "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_"
LOG_PATH_VARIABLE = ENV_PREFIX + "LOG_PATH"
GRAPPLER_OPTION = "auto_mixed_precision_onednn_bfloat16"


ONEDNN_OFF_MESSAGE = (
    "The grappler engine needs TensorFlow's oneDNN kernels, but oneDNN is off "
    "in this process (TensorFlow's default on CPUs without AVX512, or "
    "TF_ENABLE_ONEDNN_OPTS=0): the `auto_mixed_precision_onednn_bfloat16` "
    "rewrite would do nothing and the model would silently train in float32. "
    "Set `TF_ENABLE_ONEDNN_OPTS=1` in the environment before TensorFlow is "
    "imported, or use engine='keras' (per-layer dtype policies, such as "
    "'mixed_bfloat16', work without oneDNN). Received: TF_ENABLE_ONEDNN_OPTS={}"
)


def check_onednn_enabled() -> None:
    """Raise a clear error when oneDNN is off, so the rewrite cannot run.

    Without oneDNN, grappler skips `auto_mixed_precision_onednn_bfloat16`
    without a word; the switch is read once, when TensorFlow is imported.
    """
    if _compat.onednn_enabled() is False:
        value = os.environ.get("TF_ENABLE_ONEDNN_OPTS")
        raise RuntimeError(ONEDNN_OFF_MESSAGE.format(repr(value)))


def check_no_itex() -> None:
    """Raise where ITEX is installed: its remapper crashes on this rewrite.

    ITEX's graph remapper runs after grappler's and dies with a segmentation
    fault (`FindBf16ContractionGradWithCastFp32`) on a train step this
    rewrite converted to bfloat16: the process would abort at the first step.
    """
    if _compat.itex_module() is None:
        return
    raise RuntimeError(
        "engine='grappler' cannot run where Intel Extension for TensorFlow is "
        "installed: ITEX's graph remapper crashes the process (a segmentation "
        "fault) on a train step TensorFlow's bfloat16 rewrite converted. Use "
        "engine='itex', which drives ITEX's own Advanced AMP with the same op "
        "lists. Received: engine='grappler' with ITEX importable"
    )


def list_variable(field: str) -> str:
    """Return the environment variable of a list field (`denylist_add` -> ...)."""
    return ENV_PREFIX + field.upper()


TOUCHED_VARIABLES = (*(list_variable(f) for f in FIELD_NAMES), LOG_PATH_VARIABLE)


def capture_global_state() -> tuple:
    """Return `(environment, options)`: the process-global state this engine edits.

    The list variables (`TOUCHED_VARIABLES`, None where unset) and grappler's
    experimental options; `put_back_global_state` restores them exactly.
    """
    environment = {v: os.environ.get(v) for v in TOUCHED_VARIABLES}
    return environment, tf.config.optimizer.get_experimental_options()


def put_back_global_state(environment: dict, options: dict) -> None:
    """Restore what `capture_global_state` returned, unset values included."""
    for variable, value in environment.items():
        if value is None:
            os.environ.pop(variable, None)
        else:
            os.environ[variable] = value
    if GRAPPLER_OPTION in options:
        tf.config.optimizer.set_experimental_options(
            {GRAPPLER_OPTION: options[GRAPPLER_OPTION]}
        )
    else:
        _compat.reset_grappler_option(GRAPPLER_OPTION)


# The grappler engines applied and not yet restored, with the state each replaced.
_applied_engines = GlobalStateStack()


def check_user_variables(base) -> None:
    """Warn of op types in the user's list variables that TensorFlow does not know.

    Grappler ignores such an entry (a misspelt `Matmul`): the user's placement
    would be lost without a sign. Custom (`tf.load_op_library`) and internal
    (`_FusedMatMul`) op types are not in `tf.raw_ops` either, so this warns
    rather than refuses. An op type ADDed to two lists raises
    (`without_conflicts`).

    Args:
        base: `{field: value or None}`, the user's variables by list field.
    """
    for field, value in base.items():
        for op_type in split_op_types(value):
            if op_type.startswith("_"):
                continue  # internal op types are written deliberately
            try:
                check_op_types([op_type], list_variable(field))
            except ValueError as error:
                warnings.warn(
                    f"{error} Grappler ignores an op type it does not know; if "
                    "this is a custom op, ignore this warning.",
                    UserWarning,
                    stacklevel=4,
                )


class GrapplerEngine(Engine):
    """Apply op lists (and translated layer lists) through grappler.

    Args:
        log_dir: directory under which each `apply` that rebuilds the
            model's functions gets a new graph-dump subdirectory
            (`apply_001`, ...; numbers already taken are skipped, so an old
            run's dumps are never read as this run's). Defaults to
            None: the user's `TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_LOG_PATH`
            if set, else a temporary directory owned by the engine, which
            keeps the dumps of the last `KEPT_DUMPS` applies only and is
            deleted when the engine is garbage-collected (it lives as long
            as a model it applied to, so `precision_report(model)` can read
            the dumps, and until its `restore`) or when Python exits.
            Dumps in a directory you chose are yours to delete.
        dump_graphs: whether to dump the rewritten graphs (needed by
            `precision_report`). Defaults to True.

    Example:
    >>> import os
    >>> import keras
    >>> from keras_amp_plus import PrecisionLists
    >>> from keras_amp_plus.engines import GrapplerEngine
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> model.compile("sgd", "mse")
    >>> engine = GrapplerEngine()
    >>> engine.apply(model, PrecisionLists(deny_ops=("Softmax",)))
    >>> os.environ["TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_DENYLIST_ADD"]
    'Softmax'
    >>> engine.restore()
    """

    name = "grappler"
    level = "op"
    KEPT_DUMPS = 2  # the current apply and the one before, to compare them

    def __init__(self, log_dir: str | None = None, dump_graphs: bool = True):
        require_path(log_dir, "log_dir")
        self.log_dir = None if log_dir is None else os.fspath(log_dir)
        self.dump_graphs = dump_graphs
        self.dump_dir = None
        self._model = None
        self._owns_log_dir = False
        self._built = RebuildRecord()

    def _resolve_log_dir(self, environment) -> str:
        if self.log_dir is None:
            self.log_dir = environment[LOG_PATH_VARIABLE]
        if self.log_dir is None:
            self.log_dir = tempfile.mkdtemp(prefix="keras_amp_plus_grappler_")
            self._owns_log_dir = True
            # The dumps are kept for reports after training, but not forever.
            weakref.finalize(self, shutil.rmtree, self.log_dir, ignore_errors=True)
        return self.log_dir

    def _new_dump_dir(self, environment) -> str:
        """Create the next free `apply_NNN` directory (before any global change)."""
        log_dir = self._resolve_log_dir(environment)
        try:
            os.makedirs(log_dir, exist_ok=True)
            taken = sorted(
                int(name[len("apply_") :])
                for name in os.listdir(log_dir)
                if re.fullmatch(r"apply_\d+", name)
            )
            path = os.path.join(log_dir, f"apply_{(taken or [0])[-1] + 1:03d}")
            os.makedirs(path)
        except OSError as error:
            raise ValueError(
                f"The grappler engine cannot create its graph-dump directory "
                f"under {log_dir!r} ({error}). Pass a writable directory as "
                "`log_dir`, or `dump_graphs=False` (then `precision_report` "
                f"cannot count converted nodes). Received: log_dir={log_dir!r}"
            ) from error
        if self._owns_log_dir:
            for number in taken[: max(0, len(taken) + 1 - self.KEPT_DUMPS)]:
                old = os.path.join(log_dir, f"apply_{number:03d}")
                shutil.rmtree(old, ignore_errors=True)
        return path

    def check_available(self, model: keras.Model) -> None:
        """Raise where the rewrite cannot run: oneDNN off, or ITEX installed.

        With oneDNN off the rewrite would silently do nothing; ITEX's
        remapper crashes on the rewritten step (`check_no_itex`).

        Args:
            model: the Keras model (unused).
        """
        del model
        check_no_itex()
        check_onednn_enabled()

    def apply(self, model: keras.Model, lists: PrecisionLists) -> None:
        """Set the grappler option and list variables, then rebuild functions.

        Bad lists, and oneDNN being off, raise before anything changes; if a
        later step fails, the variables and the option are put back as they
        were before this call. Applied again with the same variables to the
        train function this engine last rebuilt (the next `fit` of
        `AMPMonitor`), the function and its dump directory are kept.

        Args:
            model: the Keras model the lists refer to.
            lists: a `keras_amp_plus.PrecisionLists` (or its config dict).
        """
        require_model(model, "GrapplerEngine.apply")
        lists = as_precision_lists(lists)
        check_no_itex()
        check_onednn_enabled()
        placements = op_placements(model, lists)  # raises before any change
        warn_if_xla(model, self.name)
        before = capture_global_state()
        saved = _applied_engines.original(before)[0]  # the user's variables
        base = {f: saved[list_variable(f)] for f in FIELD_NAMES}
        check_user_variables(base)
        # The user's own ADDs are paired with REMOVEs too: grappler skips the
        # whole rewrite for an op type left in its default list as well.
        fields = without_conflicts(merge_list_fields(base, placements))
        variables = {
            list_variable(field): value if value or base[field] is not None else None
            for field, value in fields.items()
        }
        current = self._built.is_current(model, variables) and (
            not self.dump_graphs or os.path.isdir(self.dump_dir or "")
        )
        dump_dir = None
        if self.dump_graphs and not current:
            dump_dir = self._new_dump_dir(saved)
        try:
            for variable, value in variables.items():
                if value is None:
                    os.environ.pop(variable, None)
                else:
                    os.environ[variable] = value
            if self.dump_graphs:
                os.environ[LOG_PATH_VARIABLE] = dump_dir or self.dump_dir
            tf.config.optimizer.set_experimental_options({GRAPPLER_OPTION: True})
            if not current:
                self._built.rebuild(model, variables)
        except BaseException:
            put_back_global_state(*before)
            raise
        _applied_engines.push(self, before)
        self.dump_dir = dump_dir or self.dump_dir
        # Weakly: the model keeps its last engine (remember_engine), and a
        # strong reference back would keep both alive forever.
        self._model = weakref.ref(model)
        remember_engine(model, self)

    def restore(self) -> None:
        """Put back the variables and grappler option this engine's lists replaced.

        That is the state before its first `apply` (or, had it re-applied over
        another engine's, that engine's); while an engine applied after it is
        still on, the state is handed on to it (`GlobalStateStack`).
        """
        if not _applied_engines.holds(self):
            return
        _applied_engines.release(self, lambda state: put_back_global_state(*state))
        model = self._model() if self._model is not None else None
        if model is not None:
            # The cached functions were optimized under the engine's lists.
            rebuild_functions(model)

"""The `itex` engine: op lists through ITEX's `itex.set_config`.

`itex.set_config` replaces ITEX's whole global config, so the engine starts
from `itex.get_config()` and only edits the auto-mixed-precision list fields,
pairing every ADD with REMOVEs from the other lists (an op type in two lists
makes ITEX skip the rewrite silently). A non-empty Python field wins over its
`ITEX_AUTO_MIXED_PRECISION_*` variable, so the starting point of each field is
the config's value, else the variable's.

On CPUs, ITEX's remapper fuses MatMul/Conv ops (`_ITEXFusedMatMul`, ...)
before the mixed-precision pass, and those fused types have list entries of
their own: placing an op type also places its fused variants, or denying
"MatMul" would leave every fused MatMul in bfloat16.

ITEX runs on TensorFlow 2.15 + Keras 2.15 only; on the Keras 3 stack `apply`
raises an ImportError with the install hint. Before training, `check_available`
also asks a child process whether ITEX's bfloat16 kernels work on this CPU
(`keras_amp_plus._itex_probe`): on its AVX2 backend the first bfloat16 MatMul
aborts the process, so the engine raises first.
"""

import os
import warnings
import weakref

import keras

from keras_amp_plus import _compat, _hardware
from keras_amp_plus import _itex_probe as itex_probe
from keras_amp_plus._arguments import require_model
from keras_amp_plus._lists.list_fields import (
    FIELD_NAMES,
    LIST_NAMES,
    merge_list_fields,
    op_placements,
    split_op_types,
    without_conflicts,
)
from keras_amp_plus._lists.precision_lists import PrecisionLists, as_precision_lists
from keras_amp_plus.engines import _itex_log as itex_log
from keras_amp_plus.engines._base import (
    Engine,
    GlobalStateStack,
    RebuildRecord,
    rebuild_functions,
    remember_engine,
    warn_if_xla,
)

ENV_PREFIX = "ITEX_AUTO_MIXED_PRECISION_"
DATA_TYPES = ("BFLOAT16", "FLOAT16")

# Fused op types of ITEX 2.15's CPU remapper that carry their own list entries
# (read from its `paintbuckets_*.txt` dump), by the op type they replace.
ITEX_FUSED_VARIANTS = {
    "MatMul": ("_ITEXFusedMatMul", "_ITEXFusedMatMulGrad", "_ITEXFusedMatMulWithSum"),
    "BatchMatMulV2": ("_ITEXFusedBatchMatMulV2",),
    "Conv2D": (
        "_ITEXFusedConv2D",
        "_ITEXFusedConv2DWithSum",
        "_ITEXPadWithConv2D",
        "_ITEXPadWithFusedConv2D",
    ),
    "Conv2DBackpropFilter": ("_ITEXConv2DBackpropFilterWithBias",),
    "Conv2DBackpropInput": ("_ITEXConv2DBackpropInputWithSlice",),
    "Conv3D": (
        "_ITEXConv3D",
        "_ITEXFusedConv3D",
        "_ITEXPadWithConv3D",
        "_ITEXPadWithFusedConv3D",
    ),
    "DepthwiseConv2dNative": (
        "_ITEXFusedDepthwiseConv2dNative",
        "_ITEXPadWithDepthwiseConv2dNative",
    ),
}

# The ITEX engines applied and not yet restored, with the config each replaced
# (ITEX's config is process-global; see `GlobalStateStack`).
_applied_engines = GlobalStateStack()

INSTALL_HINT = (
    'pip install "intel-extension-for-tensorflow[cpu]==2.15.0.0" '
    '"tensorflow==2.15.1" "keras==2.15.0"'
)


def itex_list_fields(current_fields, placements, environ=None) -> dict:
    """Return the eight ITEX list fields that put `placements` into effect.

    Args:
        current_fields: mapping from field name (`"denylist_add"`, ...) to the
            value in the user's `itex.get_config()` (empty when unset).
        placements: mapping from op type to "allow", "infer", "clear" or
            "deny".
        environ: mapping read for `ITEX_AUTO_MIXED_PRECISION_<FIELD>` when a
            field is empty. Defaults to None (`os.environ`).

    Returns:
        `{field: "Op1,Op2"}` for all eight fields.

    The user's own ADDs (config or variables) take their op types' fused
    variants along, as `placements` do (`with_fused_variants`): ITEX fuses
    most MatMuls into `_ITEXFusedMatMul`, which a `MatMul` entry alone
    leaves in low precision.

    Example:
    >>> fields = itex_list_fields({}, {"Mean": "deny"}, environ={})
    >>> fields["denylist_add"], fields["inferlist_remove"]
    ('Mean', 'Mean')
    """
    environ = os.environ if environ is None else environ
    base = {
        field: current_fields.get(field) or environ.get(ENV_PREFIX + field.upper())
        for field in FIELD_NAMES
    }
    users = {
        op_type: name
        for name in LIST_NAMES
        for op_type in split_op_types(base[f"{name}list_add"])
    }
    # The lists' placements win over the user's entries and their variants.
    placements = {**with_fused_variants(users), **placements}
    return without_conflicts(merge_list_fields(base, placements))


def with_fused_variants(placements) -> dict:
    """Return `placements` plus ITEX's fused variants of each op type placed."""
    expanded = dict(placements)
    for op_type, target in placements.items():
        for variant in ITEX_FUSED_VARIANTS.get(op_type, ()):
            expanded.setdefault(variant, target)
    return expanded


def default_data_type() -> str:
    """Return ITEX's own default: "FLOAT16" on an XPU, "BFLOAT16" on CPUs."""
    return "FLOAT16" if _hardware.has_xpu() else "BFLOAT16"


def require_itex():
    """Return the ITEX module or raise an ImportError with the install hint."""
    itex = _compat.itex_module()
    if itex is None:
        raise ImportError(
            "engine='itex' needs Intel Extension for TensorFlow, which is not "
            "importable here (it requires TensorFlow 2.15 and Keras 2.15, in an "
            f"environment of its own). Install it with `{INSTALL_HINT}`, or use "
            "engine='grappler' (stock TensorFlow) or engine='keras'. "
            "Received: engine='itex'"
        )
    return itex


def require_bfloat16_kernels() -> None:
    """Raise a RuntimeError when ITEX's bfloat16 kernels abort on this CPU."""
    status = itex_probe.itex_bfloat16_status()
    if not status["works"]:
        raise RuntimeError(
            "engine='itex' with data_type='BFLOAT16' cannot run on this CPU: "
            f"{status['reason']}. Train in float32 (no AMPMonitor engine), or use "
            "engine='keras' with the `mixed_bfloat16` policy, which runs on "
            "TensorFlow's own kernels. Received: engine='itex', "
            f"itex_backend={status['backend']!r}"
        )


def require_float16_arithmetic() -> None:
    """Raise a RuntimeError where ITEX's CPU build refuses its float16 rewrite.

    On a CPU without float16 arithmetic (AVX512-FP16, AMX-FP16) ITEX fails
    its whole Advanced AMP pass ("should be set BFLOAT16") and the model
    trains in float32.
    """
    features = _hardware.cpu_facts()["features"]
    if features is None or _hardware.has_any(features, _hardware.FLOAT16_FLAGS):
        return  # unknown: ITEX decides
    raise RuntimeError(
        "engine='itex' with data_type='FLOAT16' cannot run on this CPU: ITEX "
        "rewrites to float16 on CPUs with float16 arithmetic (AVX512-FP16) only "
        "and otherwise skips its whole Advanced AMP pass, so the model would "
        "train in float32. Use data_type='BFLOAT16' (ITEX's default on CPUs) or "
        "None. Received: engine='itex', data_type='FLOAT16', CPU features "
        f"{features}"
    )


class ItexEngine(Engine):
    """Switch on ITEX's Advanced AMP and apply op lists through `itex.set_config`.

    Args:
        data_type: ITEX's low-precision type, "BFLOAT16" or "FLOAT16".
            Defaults to `None`: ITEX's own default, "FLOAT16" on an Intel XPU
            and "BFLOAT16" on CPUs (float16 on an XPU needs loss scaling: use
            `keras_amp_plus.optimizers.LossScaleOptimizer`).

    Example:
    >>> from keras_amp_plus.engines import ItexEngine
    >>> engine = ItexEngine(data_type="BFLOAT16")
    >>> engine.name, engine.level, engine.data_type
    ('itex', 'op', 'BFLOAT16')
    """

    name = "itex"
    level = "op"

    def __init__(self, data_type: str | None = None):
        if data_type is not None and data_type not in DATA_TYPES:
            raise ValueError(
                "`data_type` must be 'BFLOAT16', 'FLOAT16' or None (ITEX's "
                f"default for the device). Received: data_type={data_type!r}"
            )
        self.data_type = data_type or default_data_type()
        self._model = None
        self._rewrites_at_apply = None
        self._built = RebuildRecord()

    def check_available(self, model: keras.Model) -> None:
        """Raise now (before any step) if this engine cannot run here.

        Without ITEX, where ITEX's bfloat16 kernels would abort the process
        (its AVX2 CPU backend), found out by a subprocess probe, or where its
        float16 rewrite would not run (a CPU without float16 arithmetic).

        Args:
            model: the Keras model (unused).
        """
        del model
        require_itex()
        on_cpu = not _hardware.has_xpu()
        if self.data_type == "BFLOAT16" and on_cpu:
            require_bfloat16_kernels()
        if self.data_type == "FLOAT16" and on_cpu:
            require_float16_arithmetic()

    def apply(self, model: keras.Model, lists: PrecisionLists) -> None:
        """Set ITEX's AMP lists from `itex.get_config()`, then rebuild.

        Applied again with the same config to the train function this engine
        last rebuilt (the next `fit` of `AMPMonitor`), the function is kept.

        Args:
            model: the Keras model the lists refer to.
            lists: a `keras_amp_plus.PrecisionLists` (or its config dict).
        """
        require_model(model, "ItexEngine.apply")
        lists = as_precision_lists(lists)
        itex = require_itex()
        if self.data_type == "FLOAT16" and not _hardware.has_xpu():
            # Cheap, unlike the bfloat16 probe: an apply that ITEX would skip
            # whole fails before the config changes, called directly too.
            require_float16_arithmetic()
        placements = with_fused_variants(op_placements(model, lists))
        warn_if_xla(model, self.name)
        config = itex.get_config()
        before = type(config)()
        before.CopyFrom(config)
        saved = _applied_engines.original(before)  # the user's own config
        saved_amp = saved.graph_options.auto_mixed_precision_options
        saved_fields = {field: getattr(saved_amp, field) for field in FIELD_NAMES}
        fields = itex_list_fields(saved_fields, placements)  # raises on conflicts
        amp = config.graph_options.auto_mixed_precision_options
        for field, value in fields.items():
            setattr(amp, field, value)
        amp.data_type = getattr(itex, self.data_type)
        config.graph_options.auto_mixed_precision = itex.ON
        settings = config.SerializeToString(deterministic=True)
        current = self._built.is_current(model, settings)
        try:
            itex.set_config(config)
            if not current:
                self._built.rebuild(model, settings)
        except BaseException:
            itex.set_config(before)  # a failed apply changes nothing global
            raise
        _applied_engines.push(self, before)
        # Weakly: the model keeps its last engine (remember_engine).
        self._model = weakref.ref(model)
        remember_engine(model, self)
        log_dir = os.environ.get(itex_log.LOG_PATH_ENV)
        if not current and log_dir and os.path.isdir(log_dir):
            # A kept function was checked after the apply that built it.
            self._rewrites_at_apply = itex_log.count_rewrites(log_dir)

    def check_rewrites(self) -> list:
        """Read ITEX's rewrite log since the last `apply`; warn if nothing ran.

        Needs `ITEX_AUTO_MIXED_PRECISION_LOG_PATH` (an existing directory);
        without it this returns `[]`. Call it after at least one step; it checks
        once per `apply` (TF optimizes a function once, so later steps add no
        dumps) and returns `[]` until the next `apply`. `AMPMonitor` calls it at
        the end of every epoch. An op
        type in two lists makes ITEX fail its pass before dumping anything
        ("Op lists have conflicting entries") and the graph stays float32: a
        rebuilt, stepped model with no new dump is reported with a warning.

        Returns:
            The new rewrites (`itex_log.read_rewrites` records).
        """
        log_dir = os.environ.get(itex_log.LOG_PATH_ENV)
        if self._rewrites_at_apply is None or not log_dir:
            return []
        records = itex_log.read_rewrites(log_dir, since=self._rewrites_at_apply)
        self._rewrites_at_apply = None
        for record in records:
            conflicts = itex_log.conflicting_ops(record["lists"])
            if conflicts:
                warnings.warn(
                    f"ITEX's lists hold op types in two lists: {conflicts}.",
                    stacklevel=2,
                )
        if not records:
            warnings.warn(
                "ITEX did not rewrite the model's functions since the lists "
                "changed: an op type in two lists (ITEX logs 'Op lists have "
                "conflicting entries') or a graph without MatMul/Conv/RNN ops. "
                "The model runs in float32. Check `itex.get_config()`.",
                stacklevel=2,
            )
        return records

    def restore(self) -> None:
        """Put back the ITEX config this engine's lists replaced.

        That is the config before its first `apply` (or, had it re-applied
        over another engine's, that engine's); while an ITEX engine applied
        after this one is still on, the config is handed on to it and its
        lists stay in force (`GlobalStateStack`).
        """
        if not _applied_engines.holds(self):
            return
        _applied_engines.release(self, require_itex().set_config)
        self._rewrites_at_apply = None
        model = self._model() if self._model is not None else None
        if model is not None:
            rebuild_functions(model)

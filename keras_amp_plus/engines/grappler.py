"""The `grappler` engine: op lists through stock TensorFlow's bf16 rewrite.

Turns on `auto_mixed_precision_onednn_bfloat16` and writes the lists into
`TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_{ALLOW,INFER,CLEAR,DENY}LIST_{ADD,REMOVE}`
(each ADD paired with REMOVEs from the other lists, starting from whatever the
user had set). Grappler re-reads these variables each time it optimizes a
function, so after a change the model's functions are rebuilt.

Each `apply` also points `TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_LOG_PATH` at a
fresh directory (`dump_dir`), where grappler writes the graphs before and after
the rewrite; `keras_amp_plus.precision_report` counts the converted nodes there.

The option and the variables are process-global: `restore()` puts back exactly
what was there before the first `apply` (unset variables are unset again).
"""

import os
import tempfile

import tensorflow as tf

from keras_amp_plus import _compat
from keras_amp_plus.engines.base import Engine, rebuild_functions, warn_if_xla
from keras_amp_plus.engines.op_lists import (
    FIELD_NAMES,
    merge_list_fields,
    op_placements,
)

ENV_PREFIX = "TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_"
LOG_PATH_VARIABLE = ENV_PREFIX + "LOG_PATH"
GRAPPLER_OPTION = "auto_mixed_precision_onednn_bfloat16"


def list_variable(field: str) -> str:
    """Return the environment variable of a list field (`denylist_add` -> ...)."""
    return ENV_PREFIX + field.upper()


TOUCHED_VARIABLES = (*(list_variable(f) for f in FIELD_NAMES), LOG_PATH_VARIABLE)


class GrapplerEngine(Engine):
    """Apply op lists (and translated layer lists) through grappler.

    Args:
        log_dir: directory under which each `apply` gets a graph-dump
            subdirectory. Defaults to None: the user's
            `TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_LOG_PATH` if set, else a new
            temporary directory (kept, so reports can be read after training).
        dump_graphs: whether to dump the rewritten graphs (needed by
            `precision_report`). Defaults to True.

    Example:
    >>> import keras
    >>> from keras_amp_plus import PrecisionLists
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

    def __init__(self, log_dir: str | None = None, dump_graphs: bool = True):
        self.log_dir = log_dir
        self.dump_graphs = dump_graphs
        self.dump_dir = None
        self._saved_environment = None
        self._saved_options = None
        self._model = None
        self._num_applies = 0

    def _save_global_state(self) -> None:
        if self._saved_environment is None:
            self._saved_environment = {v: os.environ.get(v) for v in TOUCHED_VARIABLES}
            self._saved_options = tf.config.optimizer.get_experimental_options()

    def _next_dump_dir(self) -> str:
        if self.log_dir is None:
            self.log_dir = self._saved_environment[LOG_PATH_VARIABLE] or (
                tempfile.mkdtemp(prefix="keras_amp_plus_grappler_")
            )
        self._num_applies += 1
        path = os.path.join(self.log_dir, f"apply_{self._num_applies:03d}")
        os.makedirs(path, exist_ok=True)
        return path

    def apply(self, model, lists) -> None:
        """Set the grappler option and list variables, then rebuild functions."""
        placements = op_placements(model, lists)  # raises before any change
        warn_if_xla(model, self.name)
        self._save_global_state()
        base = {f: self._saved_environment[list_variable(f)] for f in FIELD_NAMES}
        for field, value in merge_list_fields(base, placements).items():
            variable = list_variable(field)
            if value or self._saved_environment[variable] is not None:
                os.environ[variable] = value
            else:
                os.environ.pop(variable, None)
        if self.dump_graphs:
            self.dump_dir = self._next_dump_dir()
            os.environ[LOG_PATH_VARIABLE] = self.dump_dir
        tf.config.optimizer.set_experimental_options({GRAPPLER_OPTION: True})
        self._model = model
        rebuild_functions(model)

    def restore(self) -> None:
        """Put the variables and the grappler option back as they were."""
        if self._saved_environment is None:
            return
        for variable, value in self._saved_environment.items():
            if value is None:
                os.environ.pop(variable, None)
            else:
                os.environ[variable] = value
        if GRAPPLER_OPTION in self._saved_options:
            tf.config.optimizer.set_experimental_options(
                {GRAPPLER_OPTION: self._saved_options[GRAPPLER_OPTION]}
            )
        else:
            _compat.reset_grappler_option(GRAPPLER_OPTION)
        self._saved_environment = self._saved_options = None
        if self._model is not None:
            # The cached functions were optimized under the engine's lists.
            rebuild_functions(self._model)

"""The `itex` engine: op lists through ITEX's `itex.set_config`.

`itex.set_config` replaces ITEX's whole global config, so the engine starts
from `itex.get_config()` and only edits the auto-mixed-precision list fields,
pairing every ADD with REMOVEs from the other lists (an op type in two lists
makes ITEX skip the rewrite silently). A non-empty Python field wins over its
`ITEX_AUTO_MIXED_PRECISION_*` variable, so the starting point of each field is
the config's value, else the variable's.

ITEX runs on TensorFlow 2.15 + Keras 2.15 only; on the Keras 3 stack `apply`
raises an ImportError with the install hint. The real `set_config` path is
exercised by the ITEX-stack issue; the field builder (`itex_list_fields`) is a
pure function tested everywhere.
"""

import os

import keras

from keras_amp_plus import _compat
from keras_amp_plus._lists.list_fields import (
    FIELD_NAMES,
    merge_list_fields,
    op_placements,
)
from keras_amp_plus._lists.precision_lists import PrecisionLists
from keras_amp_plus.engines.base import Engine, rebuild_functions, warn_if_xla

ENV_PREFIX = "ITEX_AUTO_MIXED_PRECISION_"
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
    return merge_list_fields(base, placements)


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


class ItexEngine(Engine):
    """Apply op lists (and translated layer lists) through ITEX.

    Args:
        data_type: ITEX's low-precision type, "BFLOAT16" or "FLOAT16".
            Defaults to "BFLOAT16".
    """

    name = "itex"
    level = "op"

    def __init__(self, data_type: str = "BFLOAT16"):
        if data_type not in ("BFLOAT16", "FLOAT16"):
            raise ValueError(
                "`data_type` must be 'BFLOAT16' or 'FLOAT16'. "
                f"Received: data_type={data_type!r}"
            )
        self.data_type = data_type
        self._saved_config = None
        self._model = None

    def apply(self, model: keras.Model, lists: PrecisionLists) -> None:
        """Set ITEX's AMP lists from `itex.get_config()`, then rebuild.

        Args:
            model: the Keras model the lists refer to.
            lists: a `keras_amp_plus.PrecisionLists`.
        """
        itex = require_itex()
        placements = op_placements(model, lists)  # raises before any change
        warn_if_xla(model, self.name)
        config = itex.get_config()
        before = type(config)()
        before.CopyFrom(config)
        saved = before if self._saved_config is None else self._saved_config
        saved_amp = saved.graph_options.auto_mixed_precision_options
        saved_fields = {field: getattr(saved_amp, field) for field in FIELD_NAMES}
        amp = config.graph_options.auto_mixed_precision_options
        for field, value in itex_list_fields(saved_fields, placements).items():
            setattr(amp, field, value)
        amp.data_type = getattr(itex, self.data_type)
        config.graph_options.auto_mixed_precision = itex.ON
        try:
            itex.set_config(config)
            rebuild_functions(model)
        except BaseException:
            itex.set_config(before)  # a failed apply changes nothing global
            raise
        self._saved_config = saved
        self._model = model

    def restore(self) -> None:
        """Put ITEX's config back as it was before the first `apply`."""
        if self._saved_config is None:
            return
        require_itex().set_config(self._saved_config)
        self._saved_config = None
        if self._model is not None:
            rebuild_functions(self._model)

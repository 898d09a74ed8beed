"""`resolve_engine`: turn "keras" | "grappler" | "itex" | "auto" into an Engine.

"auto" never turns on a precision the user did not ask for. In order:

- lists holding op types ask for a graph engine: `itex` when ITEX is
  importable, else `grappler`;
- a model with a dtype policy computing in 16 bits (mixed or pure; global or
  any layer's) gets the layer engine `keras`: its policies decide its
  precision, and only they can put a float16 layer back into float32 (op
  lists cannot);
- a graph rewrite the user already switched on (grappler's
  `auto_mixed_precision_onednn_bfloat16` option, or ITEX's
  `ITEX_AUTO_MIXED_PRECISION=1`) keeps its engine;
- otherwise `keras`, which only edits per-layer dtype policies: on a float32
  model, denying a layer changes nothing at all.
"""

import os

import keras
import tensorflow as tf

from keras_amp_plus import _compat
from keras_amp_plus._lists.precision_lists import OP_FIELDS
from keras_amp_plus.engines._base import Engine
from keras_amp_plus.engines._grappler import GRAPPLER_OPTION, GrapplerEngine
from keras_amp_plus.engines._itex import ItexEngine
from keras_amp_plus.engines._keras_engine import KerasEngine, model_has_16_bit_policy

ENGINE_NAMES = ("keras", "grappler", "itex", "auto")
# `auto_mixed_precision_mkl` is the deprecated name of the same rewrite.
GRAPPLER_OPTIONS = (GRAPPLER_OPTION, "auto_mixed_precision_mkl")


def check_engine_name(engine, allow_none: bool = False) -> None:
    """Raise a Keras-style error unless `engine` is a known name or an Engine.

    Args:
        engine: the value to check.
        allow_none: whether None is accepted too. Defaults to False.

    Example:
    >>> check_engine_name("auto")
    >>> check_engine_name("xla")
    Traceback (most recent call last):
    ...
    ValueError: `engine` must be one of ['keras', 'grappler', 'itex', 'auto'] or an Engine. Received: engine='xla'
    """  # noqa: E501
    if isinstance(engine, Engine) or (allow_none and engine is None):
        return
    if isinstance(engine, str) and engine in ENGINE_NAMES:
        return
    names = list(ENGINE_NAMES)
    if allow_none:
        accepted = f"one of {names}, an Engine or None"
    else:
        accepted = f"one of {names} or an Engine"
    raise ValueError(f"`engine` must be {accepted}. Received: engine={engine!r}")


def graph_rewrite_switched_on() -> str | None:
    """Return the graph engine whose rewrite the user already switched on, or None.

    Example:
    >>> graph_rewrite_switched_on() is None
    True
    """
    itex_env = os.environ.get("ITEX_AUTO_MIXED_PRECISION", "").strip()
    if itex_env == "1" and _compat.itex_module() is not None:
        return "itex"
    options = tf.config.optimizer.get_experimental_options()
    if any(options.get(name) for name in GRAPPLER_OPTIONS):
        return "grappler"
    return None


def auto_engine_name(model: keras.Model, lists=None) -> str:
    """Return the engine name "auto" stands for (see the module docstring).

    Args:
        model: the Keras model (its dtype policies).
        lists: the `PrecisionLists` to apply, or None.

    Example:
    >>> import keras
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> auto_engine_name(model)
    'keras'
    """
    if lists is not None and any(getattr(lists, f) for f in OP_FIELDS):
        return "itex" if _compat.itex_module() is not None else "grappler"
    if model_has_16_bit_policy(model):
        return "keras"
    return graph_rewrite_switched_on() or "keras"


def resolve_engine(engine: str | Engine, model: keras.Model, lists=None) -> Engine:
    """Return the Engine for a name (or pass an Engine instance through).

    Args:
        engine: "keras", "grappler", "itex", "auto" or an `Engine`.
        model: the Keras model, used by "auto".
        lists: the `PrecisionLists` to apply, used by "auto" (op types ask for
            a graph engine). Defaults to None.

    Example:
    >>> import keras
    >>> from keras_amp_plus.engines import resolve_engine
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> resolve_engine("auto", model).name
    'keras'
    """
    check_engine_name(engine)
    if isinstance(engine, Engine):
        return engine
    if engine == "auto":
        engine = auto_engine_name(model, lists)
    return {"keras": KerasEngine, "grappler": GrapplerEngine, "itex": ItexEngine}[
        engine
    ]()

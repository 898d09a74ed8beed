"""`resolve_engine`: turn "keras" | "grappler" | "itex" | "auto" into an Engine.

"auto" picks, in order: `keras` when the model uses a mixed dtype policy (the
global policy or any layer's), since the policies already decide its precision
(on both stacks); else `itex` when ITEX is importable (its Advanced AMP
converts a float32 model by op type); else `grappler`, stock TensorFlow's
rewrite of a float32 model by op type.
"""

import keras

from keras_amp_plus import _compat
from keras_amp_plus.engines.base import Engine
from keras_amp_plus.engines.grappler import GrapplerEngine
from keras_amp_plus.engines.itex import ItexEngine
from keras_amp_plus.engines.keras_engine import KerasEngine, model_uses_mixed_policy

ENGINE_NAMES = ("keras", "grappler", "itex", "auto")


def auto_engine_name(model: keras.Model) -> str:
    """Return the engine name "auto" stands for, for this model."""
    if model_uses_mixed_policy(model):
        return "keras"
    if _compat.itex_module() is not None:
        return "itex"
    return "grappler"


def resolve_engine(engine: str | Engine, model: keras.Model) -> Engine:
    """Return the Engine for a name (or pass an Engine instance through).

    Args:
        engine: "keras", "grappler", "itex", "auto" or an `Engine`.
        model: the Keras model, used by "auto".

    Example:
    >>> import keras
    >>> model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(2)])
    >>> resolve_engine("auto", model).name
    'grappler'
    """
    if isinstance(engine, Engine):
        return engine
    if engine not in ENGINE_NAMES:
        raise ValueError(
            f"`engine` must be one of {list(ENGINE_NAMES)} or an Engine. "
            f"Received: engine={engine!r}"
        )
    if engine == "auto":
        engine = auto_engine_name(model)
    return {"keras": KerasEngine, "grappler": GrapplerEngine, "itex": ItexEngine}[
        engine
    ]()

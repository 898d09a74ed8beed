"""Engines: where `PrecisionLists` take effect.

- `keras`: layer level, per-layer Keras dtype policies (saved with the model).
- `grappler`: op level, stock TensorFlow's `auto_mixed_precision_onednn_bfloat16`
  rewrite and its `TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_*` lists.
- `itex`: op level, ITEX's `itex.set_config` (ITEX stack only).
- `auto`: the layer engine, unless the lists hold op types or a graph rewrite
  is already on (see `keras_amp_plus.engines._resolve`).

Graph engines translate layer entries to op types with `op_types_for_layer`
(the mapping is documented in `keras_amp_plus._lists.op_types`).
"""

from keras_amp_plus._lists.op_types import op_types_for_layer
from keras_amp_plus.engines._base import Engine, rebuild_functions
from keras_amp_plus.engines._grappler import GrapplerEngine
from keras_amp_plus.engines._itex import ItexEngine
from keras_amp_plus.engines._keras_engine import KerasEngine
from keras_amp_plus.engines._resolve import resolve_engine

__all__ = [
    "Engine",
    "GrapplerEngine",
    "ItexEngine",
    "KerasEngine",
    "op_types_for_layer",
    "rebuild_functions",
    "resolve_engine",
]

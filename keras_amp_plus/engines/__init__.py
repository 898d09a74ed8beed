"""Engines: where `PrecisionLists` take effect.

- `keras`: layer level, per-layer Keras dtype policies (saved with the model).
- `grappler`: op level, stock TensorFlow's `auto_mixed_precision_onednn_bfloat16`
  rewrite and its `TF_AUTO_MIXED_PRECISION_GRAPH_REWRITE_*` lists.
- `itex`: op level, ITEX's `itex.set_config` (ITEX stack only).
- `auto`: keras for a mixed-policy model, else itex if importable, else grappler.

Graph engines translate layer entries to op types with `op_types_for_layer`
(the mapping is documented in `keras_amp_plus.engines.op_types`).
"""

from keras_amp_plus.engines.base import Engine, rebuild_functions
from keras_amp_plus.engines.grappler import GrapplerEngine
from keras_amp_plus.engines.itex import ItexEngine, itex_list_fields
from keras_amp_plus.engines.keras_engine import KerasEngine
from keras_amp_plus.engines.op_lists import merge_list_fields, op_placements
from keras_amp_plus.engines.op_types import op_types_for_layer
from keras_amp_plus.engines.resolve import resolve_engine

__all__ = [
    "Engine",
    "GrapplerEngine",
    "ItexEngine",
    "KerasEngine",
    "itex_list_fields",
    "merge_list_fields",
    "op_placements",
    "op_types_for_layer",
    "rebuild_functions",
    "resolve_engine",
]

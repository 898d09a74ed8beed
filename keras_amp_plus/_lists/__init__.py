"""The lists value type and everything that only reads it.

`PrecisionLists` (`precision_lists.py`) with its validation, matching list
entries to layers (`layer_names.py`), op-type tables (`op_types.py`), the
ADD/REMOVE fields graph engines consume (`list_fields.py`) and the
environment variables they come from (`env_vars.py`). Nothing here imports
the engines or the monitor: they import this.
"""

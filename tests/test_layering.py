"""Dependencies point down: no module imports a module of a higher layer.

Layers, bottom to top: what knows Keras/TF versions and the hardware; the lists
value type and what only reads it; the layers and the loss scaler (beside each
other, never importing each other); the engines, then the report; the monitor;
the command line. Checked on the source with `ast`, so a lazy import inside a
function counts too.
"""

import ast
import pathlib

import pytest

import keras_amp_plus

PACKAGE_DIR = pathlib.Path(keras_amp_plus.__file__).parent
RANKS = (
    ("keras_amp_plus._arguments", 0),
    ("keras_amp_plus._compat", 0),
    ("keras_amp_plus._hardware", 0),
    ("keras_amp_plus._matmul_probe", 0),
    ("keras_amp_plus._itex_probe", 0),
    ("keras_amp_plus._bfloat16_outlook", 0.5),
    ("keras_amp_plus._lists", 1),
    ("keras_amp_plus.layers", 2),
    ("keras_amp_plus.optimizers", 2),
    ("keras_amp_plus.engines", 3),
    ("keras_amp_plus._report", 3.5),
    ("keras_amp_plus.callbacks", 4),
    ("keras_amp_plus.cli", 5),
    ("keras_amp_plus.__main__", 6),
)
SIBLINGS = 2  # the layers and the scaler stand beside each other, unlinked


def _module_name(path):
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _group(module):
    """Return (prefix, rank) of the layer `module` belongs to, or None (top)."""
    for prefix, rank in RANKS:
        if module == prefix or module.startswith(prefix + "."):
            return prefix, rank
    return None


def _imports(path):
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.startswith("keras_amp_plus.")}


SOURCES = sorted(PACKAGE_DIR.rglob("*.py"))


@pytest.mark.parametrize(
    "path", SOURCES, ids=lambda path: str(path.relative_to(PACKAGE_DIR))
)
def test_no_upward_imports(path):
    importer = _group(_module_name(path))
    if importer is None:
        return  # the package's own __init__ sits on top
    upward = []
    for imported in _imports(path):
        target = _group(imported)
        if target is None:
            continue  # `from keras_amp_plus import __version__`
        siblings = target[1] == importer[1] == SIBLINGS and target[0] != importer[0]
        if target[1] > importer[1] or siblings:
            upward.append(imported)
    assert not upward, f"{_module_name(path)} imports {sorted(upward)} (upward)"


def test_every_module_has_a_layer():
    names = [_module_name(path) for path in SOURCES]
    unplaced = [n for n in names if n != "keras_amp_plus" and _group(n) is None]
    assert not unplaced

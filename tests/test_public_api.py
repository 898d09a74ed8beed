"""The public surface: exported names import, no private imports, doctests pass."""

import ast
import doctest
import importlib
import inspect
import pathlib
import subprocess
import sys

import pytest
from conftest import run_python

import keras_amp_plus

PACKAGE_DIR = pathlib.Path(keras_amp_plus.__file__).parent
SOURCE_FILES = sorted(PACKAGE_DIR.rglob("*.py"))


def _module_name(path: pathlib.Path) -> str:
    # Names come from the file tree, not from importing: a module that fails to
    # import must fail its own tests, not the collection of this file.
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_public(module_name: str) -> bool:
    return not any(part.startswith("_") for part in module_name.split("."))


PUBLIC_MODULES = sorted(
    name for name in map(_module_name, SOURCE_FILES) if _is_public(name)
)
ALL_MODULES = sorted(map(_module_name, SOURCE_FILES))
# Modules whose examples switch on the grappler rewrite (see conftest.py).
NEEDS_ONEDNN = {"keras_amp_plus.engines._grappler"}
PACKAGES = sorted(
    _module_name(path)
    for path in SOURCE_FILES
    if path.name == "__init__.py" and _is_public(_module_name(path))
)

# Every public name, pinned: users, the demo, the notebooks and the README
# import these, and nothing else is public.
PUBLIC_NAMES = {
    "keras_amp_plus": (
        "AMPMonitor",
        "LossScaleOptimizer",
        "PrecisionLists",
        "__version__",
        "callbacks",
        "engines",
        "layers",
        "optimizers",
        "precision_report",
    ),
    "keras_amp_plus.layers": (
        "InstanceNormalization",
        "LayerNormalization",
        "Swish",
        "swish",
    ),
    "keras_amp_plus.optimizers": ("LossScaleOptimizer",),
    "keras_amp_plus.callbacks": ("AMPMonitor", "prepare_multi_worker_fit"),
    "keras_amp_plus.engines": (
        "Engine",
        "GrapplerEngine",
        "ItexEngine",
        "KerasEngine",
        "op_types_for_layer",
        "rebuild_functions",
        "resolve_engine",
    ),
    "keras_amp_plus.cli": ("build_parser", "main"),
}

PRIVATE_PREFIXES = ("keras.src", "tensorflow.python")


@pytest.mark.parametrize("package_name", PACKAGES)
def test_every_name_in_all_imports(package_name):
    package = importlib.import_module(package_name)
    assert hasattr(package, "__all__"), f"{package_name} has no __all__"
    assert len(set(package.__all__)) == len(package.__all__), "duplicates"
    namespace = {}
    exec(f"from {package_name} import *", namespace)  # what users would run
    for name in package.__all__:
        assert getattr(package, name) is namespace[name]


def test_the_public_packages_are_pinned():
    assert sorted(PUBLIC_NAMES) == PACKAGES


@pytest.mark.parametrize("package_name", sorted(PUBLIC_NAMES))
def test_public_names_are_pinned(package_name):
    package = importlib.import_module(package_name)
    assert sorted(package.__all__) == sorted(PUBLIC_NAMES[package_name])


def test_every_module_outside_init_is_private():
    public_modules = [
        name
        for name in PUBLIC_MODULES
        if name not in PUBLIC_NAMES and name != "keras_amp_plus.__main__"
    ]
    assert public_modules == []


def _imported_module_names(source: str) -> list:
    """Return every module name a source file imports, by any spelling."""
    names = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
            names += [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call) and node.args:
            function = node.func
            called = getattr(function, "attr", getattr(function, "id", ""))
            first = node.args[0]
            is_text = isinstance(first, ast.Constant) and isinstance(first.value, str)
            if called in ("import_module", "__import__") and is_text:
                names.append(first.value)
    return names


def private_imports(source: str) -> list:
    """Return the private Keras/TensorFlow modules a source file imports."""
    return [
        name
        for name in _imported_module_names(source)
        if any(name == p or name.startswith(f"{p}.") for p in PRIVATE_PREFIXES)
    ]


@pytest.mark.parametrize(
    "source, expected",
    [
        ("import keras.src.layers", ["keras.src.layers"]),
        ("from keras.src import ops", ["keras.src", "keras.src.ops"]),
        ("from keras import src", ["keras.src"]),
        ("import tensorflow.python as tp", ["tensorflow.python"]),
        (
            "from tensorflow.python.ops import math_ops",
            ["tensorflow.python.ops", "tensorflow.python.ops.math_ops"],
        ),
        ("importlib.import_module('keras.src.backend')", ["keras.src.backend"]),
        ("import keras\nfrom tensorflow import keras as k", []),
        ("import tensorflow_pythonic\nfrom keras import srcs", []),
    ],
)
def test_private_import_checker(source, expected):
    assert private_imports(source) == expected


@pytest.mark.parametrize(
    "path", SOURCE_FILES, ids=lambda path: str(path.relative_to(PACKAGE_DIR))
)
def test_no_private_imports_outside_compat(path):
    if path.relative_to(PACKAGE_DIR) == pathlib.Path("_compat.py"):
        return  # the one module allowed to reach private names
    found = private_imports(path.read_text(encoding="utf-8"))
    assert not found, f"{path.name} imports {found}: move it into _compat.py"


@pytest.mark.parametrize(
    "module_name",
    [
        pytest.param(name, marks=[pytest.mark.onednn] if name in NEEDS_ONEDNN else [])
        for name in ALL_MODULES
    ],
)
def test_docstring_examples(module_name):
    module = importlib.import_module(module_name)
    result = doctest.testmod(
        module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    )
    assert result.failed == 0, f"{result.failed} docstring example(s) failed"


def _public_objects():
    for package, names in PUBLIC_NAMES.items():
        module = importlib.import_module(package)
        for name in names:
            value = getattr(module, name)
            if inspect.isclass(value) or inspect.isfunction(value):
                yield f"{package}.{name}", value


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=[pytest.mark.onednn] if "Grappler" in name else [])
        for name, _ in _public_objects()
    ],
)
def test_public_examples_run_as_a_user_pastes_them(name):
    # In a namespace of their own, not their module's: every name they use
    # is imported in the example itself.
    value = dict(_public_objects())[name]
    runner = doctest.DocTestRunner(
        optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE
    )
    for test in doctest.DocTestFinder().find(value, name=name, globs={}):
        test.globs = {}
        assert runner.run(test).failed == 0, f"{test.name} needs its module"


def test_docstring_examples_are_found():
    # Guards the test above: a broken module walk would pass it vacuously.
    finder = doctest.DocTestFinder()
    examples = sum(
        len(test.examples)
        for name in ALL_MODULES
        for test in finder.find(importlib.import_module(name))
    )
    assert {"keras_amp_plus._hardware", "keras_amp_plus.cli._doctor"} <= set(
        ALL_MODULES
    )
    assert examples >= 10


def _dense_model():
    import keras

    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(2, name="d")])


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: keras_amp_plus.precision_report("m"),
            TypeError,
            r"`precision_report` expects a Keras model.*Received: model='m'",
        ),
        (
            lambda: keras_amp_plus.engines.op_types_for_layer("d"),
            TypeError,
            r"expects a Keras layer.*Received: layer='d'",
        ),
        (
            lambda: keras_amp_plus.callbacks.prepare_multi_worker_fit(None),
            TypeError,
            r"expects a Keras model.*Received: model=None",
        ),
        (
            lambda: keras_amp_plus.engines.GrapplerEngine(log_dir=3),
            TypeError,
            r"`log_dir` must be a directory path.*Received: log_dir=3",
        ),
        (
            lambda: keras_amp_plus.engines.KerasEngine().apply(_dense_model(), ["d"]),
            TypeError,
            r"`lists` must be a `keras_amp_plus.PrecisionLists`.*Received: lists=",
        ),
        (
            lambda: keras_amp_plus.PrecisionLists.from_json("{"),
            ValueError,
            r"expects the JSON text `to_json\(\)` returns.*Received: text='\{'",
        ),
    ],
    ids=["report", "op_types", "multi_worker", "grappler_log_dir", "apply", "json"],
)
def test_bad_arguments_get_keras_style_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_engines_take_the_lists_config_dict_as_the_monitor_does():
    import keras

    model = keras.Sequential(
        [keras.Input((4,)), keras.layers.Dense(2, name="d", dtype="mixed_bfloat16")]
    )
    engine = keras_amp_plus.engines.KerasEngine()
    engine.apply(model, {"deny_layers": ["d"]})
    assert model.get_layer("d").dtype_policy.name == "float32"
    engine.restore()


def test_without_tensorflow_the_import_says_what_to_install():
    # TensorFlow is an extra (a hard tensorflow-cpu would install over a
    # `tensorflow` or an XPU build): its absence is named, with the fix.
    script = (
        "import sys\n"
        "sys.modules['tensorflow'] = None  # as if not installed\n"
        "try:\n"
        "    import keras_amp_plus.layers\n"
        "except ImportError as error:\n"
        "    print(error)\n"
    )
    stdout = run_python(script, timeout=120)
    assert "keras_amp_plus needs TensorFlow" in stdout
    assert 'pip install "keras-amp-plus[cpu]"' in stdout


def test_a_package_run_with_dash_m_that_imports_this_one_registers_the_layers(
    tmp_path,
):
    # `python -m project.train` imports `project` while `sys.argv[0]` is
    # "-m": only `python -m keras_amp_plus` (the command line) skips it.
    package = tmp_path / "project"
    package.mkdir()
    (package / "__init__.py").write_text("import keras_amp_plus\n")
    (package / "train.py").write_text(
        "import keras\n"
        "print(keras.saving.get_registered_object('keras_amp_plus>Swish'))\n"
    )
    completed = subprocess.run(
        [sys.executable, "-m", "project.train"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert "Swish" in completed.stdout.splitlines()[-1]


def test_a_missing_dependency_of_tensorflow_is_not_reported_as_tensorflow():
    # TensorFlow is installed; a module it imports is not: that one is named.
    script = (
        "import importlib.abc, sys\n"
        "class Broken(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'tensorflow':\n"
        "            missing = 'google.protobuf'\n"
        "            raise ModuleNotFoundError(\n"
        "                f'No module named {missing!r}', name=missing)\n"
        "sys.meta_path.insert(0, Broken())\n"
        "try:\n"
        "    import keras_amp_plus.layers\n"
        "except ImportError as error:\n"
        "    print(type(error).__name__, error)\n"
    )
    stdout = run_python(script, timeout=120)
    assert "ModuleNotFoundError No module named 'google.protobuf'" in stdout
    assert "needs TensorFlow" not in stdout


@pytest.mark.parametrize(
    "options, module",
    [
        (["-m", "keras_amp_plus", "doctor"], "keras_amp_plus"),
        (["-mkeras_amp_plus", "doctor"], "keras_amp_plus"),
        (["-Bm", "keras_amp_plus"], "keras_amp_plus"),
        (["-W", "error", "-X", "dev", "-m", "keras_amp_plus"], "keras_amp_plus"),
        (["-Werror", "-Xutf8", "-mkeras_amp_plus.cli"], "keras_amp_plus.cli"),
        (["--check-hash-based-pycs", "always", "-m", "project"], "project"),
        (["train.py", "-m", "keras_amp_plus"], None),
        (["-c", "import keras_amp_plus", "-m", "keras_amp_plus"], None),
        (["-m"], None),
    ],
)
def test_the_command_line_is_recognised_in_every_form_of_dash_m(options, module):
    assert keras_amp_plus._module_argument(options) == module

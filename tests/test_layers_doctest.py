"""The docstring examples of the layers run and print what they claim."""

import doctest
import importlib

import pytest

MODULES = (
    "keras_amp_plus.layers.layer_normalization",
    "keras_amp_plus.layers.instance_normalization",
    "keras_amp_plus.layers.swish_activation",
    "keras_amp_plus.layers._fused_normalization",
    "keras_amp_plus.layers._keras_formula",
    "keras_amp_plus.layers._path_choice",
    "keras_amp_plus.layers._precision",
)


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples(module_name):
    module = importlib.import_module(module_name)
    results = doctest.testmod(module, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert results.attempted > 0
    assert results.failed == 0

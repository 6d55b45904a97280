"""Runs the ``>>>`` examples in every rljax.models docstring."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "__init__",
    "attention",
    "config",
    "decoder",
    "hf_io",
    "kv_cache",
    "logprobs",
    "scoring",
    "sharding",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module("rljax.models" if name == "__init__" else f"rljax.models.{name}")
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0, result

"""Runs the ``>>>`` examples in the docstrings of every rljax module (new modules included)."""

from __future__ import annotations

import doctest
import importlib
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "rljax"
MODULES = sorted(
    ".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
    for p in ROOT.rglob("*.py")
)


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    module = importlib.import_module(name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, result


def test_the_examples_exist():
    """Most modules document themselves with runnable examples (a guard against a broken collector)."""
    attempted = 0
    for name in MODULES:
        finder = doctest.DocTestFinder()
        attempted += sum(len(t.examples) for t in finder.find(importlib.import_module(name)))
    assert attempted > 300, attempted

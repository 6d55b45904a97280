"""Runs the ``>>>`` examples in the docstrings of every rljax module (new modules included).

This is the ONE place doctests run: test files of single modules do not re-run them (each re-run
recompiled the examples' JAX programs, since tests/conftest.py clears the compile caches per module).
"""

from __future__ import annotations

import doctest
import importlib
import pathlib
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "rljax"
MODULES = sorted(
    ".".join(p.relative_to(ROOT.parent).with_suffix("").parts).removesuffix(".__init__")
    for p in ROOT.rglob("*.py")
)

# Modules whose examples are part of their documented contract: at least this many must run (a
# guard against examples silently vanishing, e.g. a docstring turned into a comment). The minimums
# are the ones the modules' own test files asserted before their doctest runs moved here.
MIN_EXAMPLES = {
    "rljax.chat.base": 1,
    "rljax.core.losses": 11,
    "rljax.core.objective": 5,
    "rljax.core.off_policy": 4,
    "rljax.data.demonstrations": 1,
    "rljax.envs": 1,
    "rljax.envs.arithmetic": 1,
    "rljax.envs.base": 1,
    "rljax.envs.tool_lookup": 1,
    "rljax.evaluation": 1,
    "rljax.inference.frozen": 1,
    "rljax.inference.sampler": 1,
    "rljax.inference.scoring": 1,
    "rljax.rollout": 1,
    "rljax.training.checkpoint": 1,
    "rljax.report.metrics": 5,
    "rljax.report.records": 1,
    "rljax.report.sinks": 2,
}


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, tmp_path, monkeypatch):
    module = importlib.import_module(name)
    # the examples' tempfile.mkdtemp() folders go under pytest's own, which it prunes (not /tmp's top)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, result
    assert result.attempted >= MIN_EXAMPLES.get(name, 0), (name, result)


def test_the_examples_exist():
    """Most modules document themselves with runnable examples (a guard against a broken collector)."""
    assert set(MIN_EXAMPLES) <= set(MODULES), set(MIN_EXAMPLES) - set(MODULES)
    attempted = 0
    for name in MODULES:
        finder = doctest.DocTestFinder()
        attempted += sum(len(t.examples) for t in finder.find(importlib.import_module(name)))
    assert attempted > 300, attempted

"""Every directory of Python modules under rljax/ is a regular package (an ``__init__.py``): the
wheel's package discovery (setuptools ``find:``) skips namespace directories, so a module there would
import from a checkout and be missing from an installed wheel."""

from __future__ import annotations

import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1] / "rljax"


def test_every_module_directory_is_a_package():
    dirs = {p.parent for p in ROOT.rglob("*.py")}
    assert len(dirs) > 10
    missing = sorted(str(d.relative_to(ROOT.parent)) for d in dirs if not (d / "__init__.py").exists())
    assert not missing, f"directories with modules but no __init__.py: {missing}"

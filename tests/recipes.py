"""Loading the recipes of configs/ in tests (each call returns a fresh ConfigDict)."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_recipe(name: str) -> Any:
    """``configs/<name>.py``'s ``get_config()`` (recipes import ``configs.default``: ROOT on sys.path)."""
    spec = importlib.util.spec_from_file_location(f"_recipe_{name}", ROOT / "configs" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(ROOT))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(ROOT))
    return module.get_config()

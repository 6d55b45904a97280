"""Loading the shipped recipes (``configs/``, imported as ``rljax.recipes``) in tests: each call
returns a fresh ConfigDict."""

from __future__ import annotations

import importlib
from typing import Any


def load_recipe(name: str) -> Any:
    """``rljax.recipes.<name>.get_config()``."""
    return importlib.import_module(f"rljax.recipes.{name}").get_config()

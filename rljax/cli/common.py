"""What the subcommands share (no absl flags here: each subcommand defines its own): the shipped
recipes, and ``--config=<recipe name>`` resolved to the recipe's file."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence

__all__ = ["RECIPES_DIR", "recipe_names", "recipe_path", "resolve_config_args"]

#: The folder of the shipped recipes (``--config=<name>`` names a file in it).
RECIPES_DIR = pathlib.Path(__file__).resolve().parents[1] / "recipes"


def recipe_names() -> list[str]:
    """The names of the recipes that ship with rljax (``rljax/recipes/<name>.py``).

    >>> {"default", "smoke"} <= set(recipe_names())
    True
    """
    return sorted(p.stem for p in RECIPES_DIR.glob("*.py") if not p.stem.startswith("_"))


def recipe_path(name: str) -> pathlib.Path:
    """The file of the shipped recipe ``name``; a ``ValueError`` listing the recipes otherwise.

    >>> recipe_path("smoke").name
    'smoke.py'
    """
    path = RECIPES_DIR / f"{name}.py"
    if name.startswith("_") or not path.is_file():
        raise ValueError(f"no recipe named {name!r}; shipped recipes: {', '.join(recipe_names())}")
    return path


def _resolved(value: str) -> str:
    """A ``--config`` value with a recipe name replaced by its file (a path, with any ``:argument``
    suffix of ml_collections config files kept). A value naming an existing file is a path."""
    name, sep, arg = value.partition(":")
    if pathlib.Path(name).exists() or "/" in name or name.endswith(".py"):
        return value
    return str(recipe_path(name)) + sep + arg


def resolve_config_args(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--config=NAME`` / ``--config NAME`` naming a shipped recipe replaced by its path.

    >>> resolve_config_args(["rljax train", "--config=smoke", "--config.trainer.num_steps=2"])[1].endswith(
    ...     "recipes/smoke.py")
    True
    >>> resolve_config_args(["x", "--config=my_recipe.py"])
    ['x', '--config=my_recipe.py']
    """
    out = list(argv)
    for i, arg in enumerate(out):
        if arg.startswith("--config="):
            out[i] = "--config=" + _resolved(arg.removeprefix("--config="))
        elif arg == "--config" and i + 1 < len(out):
            out[i + 1] = _resolved(out[i + 1])
    return out

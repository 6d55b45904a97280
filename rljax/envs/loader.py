"""``"module:attr"`` import strings: the one resolver behind every name a config can point at.

Configs name user code by import string: an environment class or factory (``config.envs.<name>.env``),
its task maker (``config.envs.<name>.tasks``), a renderer (``config.renderer.name``), a reward function
(a row's ``reward_spec.method``, ``make_env("verifiable", reward_fn=...)``), an agent
(``config.envs.<name>.agent``). ``module`` is a dotted module path importable from ``sys.path``
(an installed package, or a directory on ``PYTHONPATH``); ``attr`` is a dotted attribute path in it
(``"pkg.mod:Class.method"`` works).

A string that does not resolve raises :class:`LoadError` (a ``ValueError``) whose message starts
with ``where`` (the config key path, e.g. ``config.envs.myenv.env``) and says what failed, in
``reason``: ``"format"`` (not ``module:attr``), ``"module"`` (no such module), ``"import"`` (the
module exists but importing it raised: the message carries that error), ``"attribute"`` (the module
lacks the attribute; close names are suggested) or ``"callable"`` (the object cannot be called).

>>> load_attr("math:sqrt")(9.0)
3.0
>>> try:
...     load_attr("math:sqrtt", where="config.envs.x.env")
... except LoadError as e:
...     print(e.reason, "|", e)
attribute | config.envs.x.env: cannot import 'math:sqrtt': module 'math' has no attribute 'sqrtt' (did you ...
"""

from __future__ import annotations

import difflib
import importlib
from typing import Any

__all__ = ["LoadError", "is_import_string", "load_attr", "split_import_string"]


class LoadError(ValueError):
    """An import string that does not resolve; ``reason`` is one of ``format``, ``module``,
    ``import``, ``attribute``, ``callable`` (see the module docstring)."""

    def __init__(self, message: str, *, reason: str, spec: Any, where: str | None = None) -> None:
        super().__init__(f"{where}: {message}" if where else message)
        self.reason = reason
        self.spec = spec
        self.where = where


def _dotted(text: str) -> bool:
    return bool(text) and all(part.isidentifier() for part in text.split("."))


def split_import_string(spec: Any, *, where: str | None = None) -> tuple[str, str]:
    """``(module, attr)`` of ``"module:attr"``; :class:`LoadError` (reason ``format``) otherwise.

    Checks the form only (nothing is imported), so a config can be checked where its code is absent.

    >>> split_import_string("my_pkg.envs:MyEnv")
    ('my_pkg.envs', 'MyEnv')
    """
    module, sep, attr = spec.partition(":") if isinstance(spec, str) else ("", "", "")
    if not (sep and _dotted(module) and _dotted(attr)):
        raise LoadError(
            f"expected an import string 'module:attr' (e.g. 'my_pkg.envs:MyEnv'), got {spec!r}",
            reason="format",
            spec=spec,
            where=where,
        )
    return module, attr


def is_import_string(text: Any) -> bool:
    """Whether ``text`` has the ``"module:attr"`` form (see :func:`split_import_string`).

    >>> is_import_string("pkg.mod:Cls"), is_import_string("lookup"), is_import_string("a:b:c")
    (True, False, False)
    """
    try:
        split_import_string(text)
    except LoadError:
        return False
    return True


def _missing_module(error: ModuleNotFoundError, module: str) -> bool:
    """Whether ``error`` says ``module`` itself (or a package above it) does not exist, as opposed
    to a module that exists failing to import one of ITS dependencies."""
    parts = module.split(".")
    return error.name in {".".join(parts[: i + 1]) for i in range(len(parts))}


def load_attr(spec: str, *, where: str | None = None, must_call: bool = True) -> Any:
    """The object ``"module:attr"`` names (imported now); :class:`LoadError` says what failed.

    ``where`` prefixes the message (the config key that held ``spec``); ``must_call=False`` accepts
    objects that are not callable.
    """
    module_name, attr = split_import_string(spec, where=where)

    def fail(message: str, reason: str) -> LoadError:
        return LoadError(f"cannot import {spec!r}: {message}", reason=reason, spec=spec, where=where)

    try:
        obj: Any = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if _missing_module(e, module_name):
            raise fail(
                f"no module named {e.name!r} (is its package installed, or its directory on PYTHONPATH?)",
                "module",
            ) from e
        raise fail(f"importing module {module_name!r} raised {type(e).__name__}: {e}", "import") from e
    except Exception as e:  # the module's own code failed: report it, it is the user's to fix
        raise fail(f"importing module {module_name!r} raised {type(e).__name__}: {e}", "import") from e
    found: list[str] = []
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            close = difflib.get_close_matches(part, [n for n in dir(obj) if not n.startswith("_")], n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            owner = f"{module_name}:{'.'.join(found)}" if found else f"module {module_name!r}"
            raise fail(f"{owner} has no attribute {part!r}{hint}", "attribute") from None
        found.append(part)
    if must_call and not callable(obj):
        raise LoadError(
            f"{spec!r} is not callable: it names {type(obj).__name__} {obj!r:.60}, not a class or function",
            reason="callable",
            spec=spec,
            where=where,
        )
    return obj

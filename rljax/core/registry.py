"""A small name -> value registry shared by the estimator and policy-loss registries.

:mod:`rljax.core.advantages` keeps one :class:`Registry` of
:class:`~rljax.core.advantages.Estimator` values and :mod:`rljax.core.losses` one of
:class:`~rljax.core.losses.PolicyLoss` values. Each value carries its function, its keyword
hyperparameters with their defaults and its rules, so every reader (``rljax.algorithms``,
the objective, config validation, the host data path) looks up the same thing.

**One convention for functions.** A registered function takes its data inputs as
positional parameters and its hyperparameters as keyword-only parameters; the defaults are
declared once, in the function's signature, and :func:`signature_parts` reads both.

>>> reg = Registry("widget")
>>> reg.register("a", 1)
1
>>> reg.get("a"), reg.names(), "a" in reg.view
(1, ['a'], True)
>>> try:
...     reg.get("b")
... except ValueError as e:
...     print(e)
unknown widget 'b'; choose one of ['a']
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from types import MappingProxyType
from typing import Any, Generic, TypeVar

__all__ = ["Registry", "check_hyperparameters", "check_required", "freeze_defaults", "signature_parts"]

T = TypeVar("T")


class Registry(Generic[T]):
    """Values by name; names are non-empty strings, replacing one needs ``overwrite=True``."""

    def __init__(self, what: str) -> None:
        self.what = what
        self._values: dict[str, T] = {}
        #: A read-only live view of the registry (name -> value).
        self.view: Mapping[str, T] = MappingProxyType(self._values)

    def register(self, name: str, value: T, *, overwrite: bool = False) -> T:
        """Registers ``value`` under ``name`` and returns it; a taken name raises ``ValueError`` unless
        ``overwrite``."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a {self.what} name must be a non-empty str, got {name!r}")
        if name in self._values and not overwrite:
            raise ValueError(f"{self.what} {name!r} is already registered; pass overwrite=True to replace it")
        self._values[name] = value
        return value

    def get(self, name: str) -> T:
        """The value registered as ``name``; an unknown name raises ``ValueError`` listing the known ones."""
        if not isinstance(name, str) or name not in self._values:
            raise ValueError(f"unknown {self.what} {name!r}; choose one of {self.names()}")
        return self._values[name]

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._values)


def signature_parts(
    fn: Callable[..., Any], what: str
) -> tuple[tuple[str, ...] | None, dict[str, Any], list[str]]:
    """``(positional input names, keyword-only defaults, keyword-only names without a default)``.

    The positional parameters of ``fn`` are its data inputs (``None`` when ``fn`` takes
    ``*args``: they cannot be named); its keyword-only parameters are its hyperparameters,
    and their defaults in the signature are the registered defaults. An unreadable
    signature raises ``ValueError`` (declare the inputs and defaults explicitly).

    >>> def f(x, y, rng=None, *, a=1, b=2.0, c, **kw):
    ...     pass
    >>> signature_parts(f, "f")
    (('x', 'y', 'rng'), {'a': 1, 'b': 2.0}, ['c'])
    >>> signature_parts(lambda *arrays, scale=1.0: None, "g")
    (None, {'scale': 1.0}, [])
    """
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError) as e:
        raise ValueError(
            f"{what}: cannot read the signature of {fn!r}; declare its inputs and defaults explicitly"
        ) from e
    positional = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    inputs = tuple(p.name for p in params if p.kind in positional)
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        inputs = None
    keyword = [p for p in params if p.kind is p.KEYWORD_ONLY]
    defaults = {p.name: p.default for p in keyword if p.default is not p.empty}
    return inputs, defaults, [p.name for p in keyword if p.default is p.empty]


def check_required(what: str, fn: Callable[..., Any], defaults: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` when a keyword-only parameter of ``fn`` has no default anywhere.

    >>> def f(x, *, a):
    ...     pass
    >>> check_required("loss 'f'", f, {"a": 1})
    >>> try:
    ...     check_required("loss 'f'", f, {})
    ... except ValueError as e:
    ...     print(e)
    loss 'f': keyword(s) ['a'] of its function have no default (give one in its signature or in defaults)
    """
    try:
        _, _, required = signature_parts(fn, what)
    except ValueError:
        return  # nothing to check against
    missing = sorted(set(required) - set(defaults))
    if missing:
        raise ValueError(
            f"{what}: keyword(s) {missing} of its function have no default (give one in its "
            "signature or in defaults)"
        )


def freeze_defaults(defaults: Any, what: str) -> Mapping[str, Any]:
    """Checks ``defaults`` (str -> hashable value) and returns a read-only copy.

    >>> dict(freeze_defaults({"eps": 0.2}, "loss"))
    {'eps': 0.2}
    """
    if hasattr(defaults, "to_dict"):  # ml_collections.ConfigDict
        defaults = defaults.to_dict()
    if not isinstance(defaults, Mapping):
        raise ValueError(f"{what}: defaults must be a mapping name -> default value, got {defaults!r}")
    for k, v in defaults.items():
        if not isinstance(k, str) or not k.isidentifier():
            raise ValueError(f"{what}: hyperparameter names must be identifiers, got {k!r}")
        try:
            hash(v)
        except TypeError as e:
            raise ValueError(
                f"{what}: default of {k!r} must be hashable (static under jit), got {v!r}"
            ) from e
        if isinstance(v, float) and not math.isfinite(v):
            raise ValueError(f"{what}: default of {k!r} must be finite, got {v!r}")
    return MappingProxyType(dict(defaults))


def check_hyperparameters(what: str, given: Mapping[str, Any], accepted: Mapping[str, Any]) -> None:
    """Raises ``ValueError`` naming the hyperparameters of ``given`` that ``accepted`` lacks.

    >>> check_hyperparameters("loss 'x'", {"eps": 1}, {"eps": 0.2})
    >>> try:
    ...     check_hyperparameters("loss 'x'", {"eps": 1, "tau": 2}, {"eps": 0.2})
    ... except ValueError as e:
    ...     print(e)
    loss 'x' got unknown hyperparameters ['tau']; it accepts ['eps']
    """
    unknown = sorted(set(given) - set(accepted))
    if unknown:
        accepts = sorted(accepted) or "none"
        raise ValueError(f"{what} got unknown hyperparameters {unknown}; it accepts {accepts}")

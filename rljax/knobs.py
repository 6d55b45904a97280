"""Config knobs declared once: type, default, allowed values and meaning on the dataclass field.

A config class of rljax (a section of the run config, or a component's own config that the run
config holds) is a frozen dataclass decorated with :func:`section`; each of its fields is a
:func:`knob`::

    @knobs.section
    class TrainerSection:
        seq_len: int = knob(384, ge=1, doc="tokens per packed row")
        mode: str = knob("sync", choices=("sync", "async"), doc="how rollouts overlap training")

That one line is the whole declaration of the key: its type (the annotation), its default, its
allowed range (``ge`` / ``gt`` / ``le`` / ``lt``) or values (``choices``), and its one-line meaning
(``doc``). Everything else reads it from there: the class checks every value when it is made (a
:class:`ValueError` ``"<Class>.<field>: expected ..., got ..."``, which the run config turns into
the key's path, e.g. ``config.trainer.seq_len: expected an int >= 1, got 0``), its docstring gets an
``Attributes:`` block (the API reference), and the config reference lists the key with its type,
default, meaning and allowed values. Rules between several fields stay explicit code (a
``__post_init__`` of the class, or the run config's cross-field checks).

A field typed ``X | None`` takes None whatever its range (an optional number: None means "off" or
"the default"); with ``choices``, None is allowed only when listed.

>>> @section
... class Example:
...     '''An example section.'''
...
...     steps: int = knob(3, ge=0, doc="how many steps")
...     mode: str = knob("a", choices=("a", "b"), doc="which mode")
>>> Example(steps=2).steps
2
>>> Example(steps=-1)
Traceback (most recent call last):
...
ValueError: Example.steps: expected an int >= 0, got -1
>>> Example(steps=2.5)
Traceback (most recent call last):
...
ValueError: Example.steps: expected an int >= 0, got 2.5
>>> import numpy as np
>>> Example(steps=np.int32(2)).steps  # numpy scalars are numbers too
np.int32(2)
>>> Example(mode="c")
Traceback (most recent call last):
...
ValueError: Example.mode: expected one of ['a', 'b'], got 'c'
>>> import inspect
>>> inspect.cleandoc(Example.__doc__).splitlines()[-3:]
['Attributes:', '  steps: how many steps (>= 0).', "  mode: which mode (one of 'a', 'b')."]
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import math
import numbers
import re
import types
import typing
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

__all__ = ["Knob", "allowed", "check", "field_doc", "knob", "knob_of", "section"]

_T = TypeVar("_T")
_METADATA_KEY = "rljax.knob"


@dataclasses.dataclass(frozen=True)
class Knob:
    """What a :func:`knob` field declares besides its type and default (its field's metadata).

    Attributes:
      doc: the key's one-line meaning.
      choices: the allowed values (None: any value of the field's type).
      ge: the smallest allowed value (inclusive).
      gt: the values must be greater than this.
      le: the largest allowed value (inclusive).
      lt: the values must be smaller than this.
      fields_of: a dataclass whose fields are the keys of this mapping-valued field (each typed and
        defaulted by that class; see :mod:`rljax.run.config`'s ``model.init``).
    """

    doc: str
    choices: tuple[Any, ...] | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    fields_of: type | None = None


def knob(
    default: Any = dataclasses.MISSING,
    *,
    doc: str,
    choices: Sequence[Any] | None = None,
    ge: float | None = None,
    gt: float | None = None,
    le: float | None = None,
    lt: float | None = None,
    fields_of: type | None = None,
    compare: bool = True,
) -> Any:
    """A dataclass field declaring one config key whole (module docstring).

    A mutable default (a dict, list, set or dataclass instance) is copied for every instance.
    Without ``default`` the field is required.
    """
    meta = Knob(" ".join(doc.split()), None if choices is None else tuple(choices), ge, gt, le, lt, fields_of)
    kwargs: dict[str, Any] = {"metadata": {_METADATA_KEY: meta}, "compare": compare}
    if isinstance(default, (dict, list, set)) or (
        dataclasses.is_dataclass(default) and not isinstance(default, type)
    ):
        kwargs["default_factory"] = lambda: copy.deepcopy(default)
    elif default is not dataclasses.MISSING:
        kwargs["default"] = default
    return dataclasses.field(**kwargs)


def knob_of(field: dataclasses.Field) -> Knob | None:
    """The :class:`Knob` a field was declared with (None: a plain dataclass field)."""
    return field.metadata.get(_METADATA_KEY)


def allowed(k: Knob) -> str:
    """The allowed values of a knob as words ("" when any value of its type is allowed).

    >>> allowed(Knob("x", ge=0, lt=1)), allowed(Knob("x", gt=0)), allowed(Knob("x", choices=(None, "a")))
    ('in [0, 1)', '> 0', "one of None, 'a'")
    """
    if k.choices is not None:
        return "one of " + ", ".join(repr(c) for c in k.choices)
    low = (f"[{_num(k.ge)}" if k.ge is not None else f"({_num(k.gt)}") if (k.ge, k.gt) != (None, None) else ""
    high = (
        (f"{_num(k.le)}]" if k.le is not None else f"{_num(k.lt)})") if (k.le, k.lt) != (None, None) else ""
    )
    if low and high:
        return f"in {low}, {high}"
    if low:
        return (">= " if low[0] == "[" else "> ") + low[1:]
    if high:
        return ("<= " if high[-1] == "]" else "< ") + high[:-1]
    return ""


def _num(x: float) -> str:
    """``x`` as written in a rule: ``0`` for 0.0, ``0.5``, ``inf``."""
    return str(int(x)) if math.isfinite(x) and float(x).is_integer() else repr(x)


def field_doc(field: dataclasses.Field) -> str:
    """A knob field's meaning with its allowed values, e.g. ``"tokens per packed row (>= 1)."``
    ("" for a plain field)."""
    k = knob_of(field)
    if k is None:
        return ""
    text = k.doc.rstrip(".")
    rule = allowed(k)
    return f"{text} ({rule})." if rule else f"{text}."


@functools.cache
def _field_kinds(cls: type) -> dict[str, tuple[bool, bool]]:
    """Field -> (its type admits None: ``X | None`` or ``Any``; it is an int: ``int`` or ``int | None``)."""
    try:
        hints: dict[str, Any] = typing.get_type_hints(cls)
    except (NameError, TypeError):  # an annotation its module cannot evaluate (yet): read its text
        hints = {f.name: str(f.type) for f in dataclasses.fields(cls)}
    out = {}
    for name, hint in hints.items():
        if isinstance(hint, str):
            optional = bool(re.search(r"\bNone\b|Optional\[|\bAny\b", hint))
            integer = bool(re.fullmatch(r"int( \| None)?|Optional\[int\]", hint))
        else:
            union = typing.get_origin(hint) in (typing.Union, types.UnionType)
            args = typing.get_args(hint) if union else (hint,)
            optional = hint is Any or type(None) in args
            integer = [a for a in args if a is not type(None)] == [int]
        out[name] = (optional, integer)
    return out


def _violation(k: Knob, value: Any, integer: bool, optional: bool) -> str | None:
    """Why ``value`` breaks ``k`` ("expected ..., got ..."), or None."""
    if k.choices is not None:
        if any(c is value or (type(c) is type(value) and c == value) for c in k.choices):
            return None
        return f"expected one of {list(k.choices)}, got {value!r}"
    if (k.ge, k.gt, k.le, k.lt) == (None, None, None, None) or (value is None and optional):
        return None
    what = "an int" if integer else "a number"
    number = isinstance(value, numbers.Real) and not isinstance(value, bool)  # numpy scalars too
    if (
        not number
        or (integer and not isinstance(value, numbers.Integral))
        or math.isnan(value)
        or (k.ge is not None and value < k.ge)
        or (k.gt is not None and value <= k.gt)
        or (k.le is not None and value > k.le)
        or (k.lt is not None and value >= k.lt)
    ):
        return f"expected {what} {allowed(k)}{' or None' if optional else ''}, got {value!r}"
    return None


def check(obj: Any) -> None:
    """Checks every knob field of the dataclass instance ``obj`` against its declaration; the first
    violation is a ``ValueError`` ``"<Class>.<field>: expected ..., got ..."``."""
    kinds = _field_kinds(type(obj))
    for field in dataclasses.fields(obj):
        k = knob_of(field)
        if k is None:
            continue
        optional, integer = kinds.get(field.name, (False, False))
        why = _violation(k, getattr(obj, field.name), integer, optional)
        if why is not None:
            raise ValueError(f"{type(obj).__name__}.{field.name}: {why}")


def section(cls: type[_T]) -> type[_T]:
    """``cls`` as a frozen dataclass whose knob fields are checked when an instance is made (before
    ``cls``'s own ``__post_init__``, if it has one) and documented in its docstring's
    ``Attributes:`` block (module docstring)."""
    own: Callable[[Any], None] | None = cls.__dict__.get("__post_init__")

    def __post_init__(self: Any) -> None:
        check(self)
        if own is not None:
            own(self)

    __post_init__.__doc__ = "Checks the knobs (:func:`rljax.knobs.check`), then the class's own rules."
    cls.__post_init__ = __post_init__  # type: ignore[attr-defined]
    cls = dataclasses.dataclass(frozen=True)(cls)
    cls.__doc__ = _with_attributes(cls)
    return cls


def _with_attributes(cls: type) -> str:
    """``cls``'s docstring with an ``Attributes:`` block of its knob fields appended (indented as the
    docstring is, so that ``inspect.cleandoc`` reads one block)."""
    head = (cls.__doc__ or "").rstrip()
    rows = [(f.name, field_doc(f)) for f in dataclasses.fields(cls)]
    rows = [(name, doc) for name, doc in rows if doc]
    if not rows:
        return head
    body = head.splitlines()[1:]
    indent = min((len(line) - len(line.lstrip()) for line in body if line.strip()), default=4)
    pad = " " * indent
    block = [f"{pad}Attributes:"] + [f"{pad}  {name}: {doc}" for name, doc in rows]
    return "\n".join([head, "", *block]) if head else "\n".join(line.strip() for line in block)

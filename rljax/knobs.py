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

A mapping of overrides of another class's fields (``overrides_of``: e.g. the warm start's
``optimizer``, a few :class:`rljax.training.optimizer.OptimizerConfig` fields over the run's) takes
only that class's field names as keys (an unknown one is refused with a "did you mean"), each value
checked against that field's declaration. :func:`knob_from` declares a field on a second class as
another class declares it (a frozen model's client knobs are the vLLM client's).

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
>>> @section
... class Overrides:
...     example: dict = knob({}, overrides_of=Example, doc="Example fields to override")
>>> Overrides(example={"steps": 5}).example
{'steps': 5}
>>> Overrides(example={"step": 5})
Traceback (most recent call last):
...
ValueError: Overrides.example.step: unknown key; did you mean 'steps'? known keys: ['steps', 'mode']
>>> Overrides(example={"steps": -5})
Traceback (most recent call last):
...
ValueError: Overrides.example.steps: expected an int >= 0, got -5
>>> import inspect
>>> inspect.cleandoc(Example.__doc__).splitlines()[-3:]
['Attributes:', '  steps: how many steps (>= 0).', "  mode: which mode (one of 'a', 'b')."]
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import numbers
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

__all__ = ["Knob", "allowed", "check", "did_you_mean", "field_doc", "knob", "knob_from", "knob_of", "section"]

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
      overrides_of: a dataclass some of whose fields this mapping-valued field overrides (each key one
        of its fields, each value checked by that field's knob; the others come from elsewhere).
    """

    doc: str
    choices: tuple[Any, ...] | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    fields_of: type | None = None
    overrides_of: type | None = None


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
    overrides_of: type | None = None,
    compare: bool = True,
) -> Any:
    """A dataclass field declaring one config key whole (module docstring).

    A mutable default (a dict, list, set or dataclass instance) is copied for every instance.
    Without ``default`` the field is required.
    """
    choices = None if choices is None else tuple(choices)
    meta = Knob(" ".join(doc.split()), choices, ge, gt, le, lt, fields_of, overrides_of)
    return _field(default, meta, compare)


def _field(default: Any, meta: Knob, compare: bool = True) -> Any:
    """The dataclass field of a knob (a mutable default copied for every instance)."""
    kwargs: dict[str, Any] = {"metadata": {_METADATA_KEY: meta}, "compare": compare}
    if isinstance(default, (dict, list, set)) or (
        dataclasses.is_dataclass(default) and not isinstance(default, type)
    ):
        kwargs["default_factory"] = lambda: copy.deepcopy(default)
    elif default is not dataclasses.MISSING:
        kwargs["default"] = default
    return dataclasses.field(**kwargs)


def knob_from(cls: type, name: str, *, doc: str | None = None) -> Any:
    """A knob field declared as ``cls``'s field ``name`` is: its default, allowed values and meaning
    (``doc`` replaces the meaning); the new field's annotation is written as usual.

    >>> @section
    ... class Client:
    ...     retries: int = knob(3, ge=0, doc="retries of a request")
    >>> @section
    ... class Frozen:
    ...     retries: int = knob_from(Client, "retries")
    >>> Frozen().retries, field_doc(dataclasses.fields(Frozen)[0])
    (3, 'retries of a request (>= 0).')
    """
    field = next(f for f in dataclasses.fields(cls) if f.name == name)
    meta = knob_of(field)
    if meta is None:
        raise TypeError(f"{cls.__name__}.{name} is not a knob")
    if doc is not None:
        meta = dataclasses.replace(meta, doc=" ".join(doc.split()))
    default = field.default if field.default_factory is dataclasses.MISSING else field.default_factory()
    return _field(default, meta, field.compare)


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
    if k.overrides_of is not None:
        return f"keys: {k.overrides_of.__name__} fields"
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
    violation is a ``ValueError`` ``"<Class>.<field>: expected ..., got ..."`` (``<Class>.<field>.<key>``
    for a key of an ``overrides_of`` mapping)."""
    kinds = _field_kinds(type(obj))
    for field in dataclasses.fields(obj):
        k = knob_of(field)
        if k is None:
            continue
        where = f"{type(obj).__name__}.{field.name}"
        value = getattr(obj, field.name)
        if k.overrides_of is not None:
            _check_overrides(k.overrides_of, value, where)
            continue
        optional, integer = kinds.get(field.name, (False, False))
        why = _violation(k, value, integer, optional)
        if why is not None:
            raise ValueError(f"{where}: {why}")


def did_you_mean(key: str, known: Any) -> str:
    """``"did you mean 'x'? "`` for the known name closest to a mistyped ``key``, or whose words'
    initials ``key`` is (``lr``: ``learning_rate``); empty if none is close.

    >>> did_you_mean("num_stpes", ["num_steps", "seq_len"])
    "did you mean 'num_steps'? "
    >>> did_you_mean("lr", ["eps", "learning_rate"])
    "did you mean 'learning_rate'? "
    >>> did_you_mean("zzz", ["num_steps"])
    ''
    """
    names = [str(k) for k in known]
    close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.6)
    close = close or [n for n in names if "_" in n and "".join(w[:1] for w in n.split("_")) == str(key)]
    return f"did you mean {close[0]!r}? " if close else ""


def _check_overrides(cls: type, value: Any, where: str) -> None:
    """``value``: a mapping of some of ``cls``'s knob fields, each value within its declaration."""
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: expected a mapping of {cls.__name__} fields, got {value!r}")
    fields = {f.name: f for f in dataclasses.fields(cls) if knob_of(f) is not None}
    kinds = _field_kinds(cls)
    for key, v in value.items():
        if key not in fields:
            raise ValueError(
                f"{where}.{key}: unknown key; {did_you_mean(key, fields)}known keys: {list(fields)}"
            )
        optional, integer = kinds.get(key, (False, False))
        why = _violation(knob_of(fields[key]), v, integer, optional)
        if why is not None:
            raise ValueError(f"{where}.{key}: {why}")


def section(cls: type[_T]) -> type[_T]:
    """``cls`` as a frozen dataclass whose knob fields are checked when an instance is made (before
    ``cls``'s own ``__post_init__``, if it has one, else the rules of the section it derives from)
    and documented in its docstring's ``Attributes:`` block (module docstring)."""
    own: Callable[[Any], None] | None = cls.__dict__.get("__post_init__")
    if own is None:  # a subclass of a section keeps its base's rules (its knobs are checked anyway)
        inherited = getattr(cls, "__post_init__", None)
        own = getattr(inherited, "rules", inherited)

    def __post_init__(self: Any) -> None:
        check(self)
        if own is not None:
            own(self)

    __post_init__.__doc__ = "Checks the knobs (:func:`rljax.knobs.check`), then the class's own rules."
    __post_init__.rules = own  # type: ignore[attr-defined]
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

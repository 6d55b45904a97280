"""The generated parts of rljax's documentation: the API reference and the config reference.

The API reference documents every public module of rljax (a module is public unless a part of its
dotted name starts with ``_``) on one page per module or package directly in rljax, plus rljax's
own page: ``rljax.core``'s page holds one section per module of ``rljax.core``. The pages are
written into ``reference/api/`` when the build starts (the folder is not committed: every build
regenerates it from the code). A module's public names are its ``__all__`` where it defines one,
else the classes and functions it defines at top level. Each name is documented in full once, in
the section of the module that defines it; a package that re-exports it lists it in its summary
table with a link there.

The config reference replaces the marker ``<!-- rljax:config-reference -->`` in
``reference/config.md`` by one table per section of :class:`rljax.run.config.RunConfig`: every key's
path, type, default and meaning. The meaning of a field declared with :func:`rljax.knobs.knob` is
its ``doc`` with its allowed values; of another field, its entry in the ``Attributes:`` block of its
section's docstring (or a base class's), else its ``#:`` comment in the class body. A mapping field
declared with ``fields_of`` (``model.init``: :class:`rljax.models.ModelConfig`'s fields) gets the
table of that class's fields.

``python docs/_ext/rljax_reference.py`` prints the config reference's Markdown and the count of
public names without a docstring.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import io
import pathlib
import pkgutil
import pprint
import re
import sys
import textwrap
import tokenize
import types
import typing
from collections.abc import Iterator
from typing import Any

PACKAGE = "rljax"
API_DIR = "reference/api"  # relative to the docs source folder
CONFIG_MARKER = "<!-- rljax:config-reference -->"
INDEX_MARKER = "<!-- rljax:module-index -->"


# -- public modules and names ---------------------------------------------------------------------


def public_modules() -> list[str]:
    """Every public module of rljax, imported (sorted by name; packages before their modules)."""
    package = importlib.import_module(PACKAGE)
    names = [PACKAGE]
    for info in pkgutil.walk_packages(package.__path__, f"{PACKAGE}.", onerror=_raise):
        if not any(part.startswith("_") for part in info.name.split(".")):
            names.append(info.name)
    for name in names:
        importlib.import_module(name)
    return sorted(names, key=lambda n: n.split("."))


def _raise(name: str) -> None:
    raise ImportError(f"cannot import {name} while walking {PACKAGE}'s modules")


def public_names(module: types.ModuleType) -> list[str]:
    """``module.__all__`` where defined, else the classes and functions it defines at top level."""
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and value.__module__ == module.__name__
    ]


def _assigned_names(module: types.ModuleType) -> set[str]:
    """Names bound by a top-level assignment in the module's source (where its data is defined)."""
    try:
        tree = ast.parse(inspect.getsource(module))
    except (OSError, TypeError):
        return set()
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                elts = target.elts if isinstance(target, ast.Tuple) else [target]
                names.update(t.id for t in elts if isinstance(t, ast.Name))
    return names


@dataclasses.dataclass(frozen=True)
class Entry:
    """One documented name of one module: ``home`` is the dotted path where it is documented in full;
    ``public`` is False for a constant that a module without ``__all__`` documents (``#:``) besides
    its public names (autodoc's own rule for such modules)."""

    module: str
    name: str
    home: str
    kind: str  # "class", "function", "exception" or "data"
    public: bool = True

    @property
    def is_home(self) -> bool:
        return self.home == f"{self.module}.{self.name}"


def _kind(value: Any) -> str:
    if inspect.isclass(value):
        return "exception" if issubclass(value, BaseException) else "class"
    if inspect.isroutine(value) or (callable(value) and hasattr(value, "__wrapped__")):
        return "function"
    return "data"


def object_key(value: Any, name: str) -> Any:
    """What identifies a documented object: a class or function by identity; data by its name too
    (equal small ints and interned strings are one object in Python)."""
    return ("data", name, id(value)) if _kind(value) == "data" else id(value)


def _documented_constants(module: str, names: list[str]) -> list[str]:
    """Constants that a module without ``__all__`` assigns and documents, besides ``names``."""
    mod = sys.modules[module]
    if hasattr(mod, "__all__"):
        return []
    assigned = _assigned_names(mod)
    return [
        n
        for n in attribute_docs(module)
        if not n.startswith("_")
        and n not in names
        and n in assigned
        and _kind(getattr(mod, n, None)) == "data"
    ]


def reference_entries(modules: list[str]) -> dict[str, list[Entry]]:
    """module -> its public names with the place each is documented (exactly one place per object),
    then the other constants it documents (see :class:`Entry`)."""
    names = {m: public_names(sys.modules[m]) for m in modules}
    homes: dict[Any, str] = {}
    for module in modules:  # definitions first: a name documented where its code lives
        mod = sys.modules[module]
        assigned = _assigned_names(mod)
        for name in names[module]:
            value = getattr(mod, name)
            defined_here = (
                getattr(value, "__module__", None) == module and getattr(value, "__qualname__", None) == name
            )
            if _kind(value) == "data":
                defined_here = name in assigned
            if defined_here:
                homes.setdefault(object_key(value, name), f"{module}.{name}")
    out: dict[str, list[Entry]] = {}
    for module in modules:  # re-exports of an object defined elsewhere (or privately) link to one home
        mod = sys.modules[module]
        entries = []
        for name in names[module]:
            value = getattr(mod, name)
            home = homes.setdefault(object_key(value, name), f"{module}.{name}")
            entries.append(Entry(module, name, home, _kind(value)))
        for name in _documented_constants(module, names[module]):
            home = homes.setdefault(object_key(getattr(mod, name), name), f"{module}.{name}")
            entries.append(Entry(module, name, home, "data", public=False))
        out[module] = entries
    return out


# -- the API pages ---------------------------------------------------------------------------------

_DIRECTIVE = {
    "class": "autoclass",
    "exception": "autoexception",
    "function": "autofunction",
    "data": "autodata",
}


_UNDERLINES = "=-~^\"'"  # section levels of a page: its own module, then one per level below it


def _title(text: str, level: int = 0) -> str:
    return f"{text}\n{_UNDERLINES[level] * len(text)}\n"


def module_section(module: str, entries: list[Entry], level: int = 0) -> str:
    """The reStructuredText section of one module (a section title of ``level``): its docstring, a
    summary table, each name it is the home of in full."""
    lines = [_title(module, level), f".. automodule:: {module}", "   :no-members:", ""]
    if any(e.public for e in entries):
        lines += ["", ".. rubric:: Public names", "", ".. list-table::", "   :widths: 30 70", ""]
        for e in (e for e in entries if e.public):
            lines += [
                f"   * - :py:obj:`~{e.home}`",
                f"     - {summary(module, e.name)}",
            ]
        lines.append("")
    own = attribute_docs(module)
    for e in entries:
        if not e.is_home:
            continue
        lines.append(f".. {_DIRECTIVE[e.kind]}:: {e.home}")
        if e.kind in ("class", "exception"):
            lines += ["   :members:", "   :show-inheritance:"]
        if e.kind == "data" and e.name not in own:  # assigned in a module that does not list it
            lines += ["", *(f"   {line}" for line in data_docs(module, e.name).splitlines())]
        lines.append("")
    return "\n".join(lines)


def page_of(module: str) -> str:
    """The page that documents ``module``: rljax's own, or that of the module or package of rljax
    that holds it (``rljax.core.losses`` -> ``rljax.core``)."""
    return ".".join(module.split(".")[:2])


def api_page(page: str, modules: list[str], entries: dict[str, list[Entry]]) -> str:
    """The reStructuredText page ``page``: the section of its module, then, in name order, one nested
    section per module below it (``rljax``'s page holds a toctree of the other pages instead)."""
    below = [m for m in modules if m != page and page_of(m) == page] if page != PACKAGE else []
    text = module_section(page, entries[page])
    if page == PACKAGE:
        children = [m for m in modules if m != PACKAGE and page_of(m) == m]
        text += "\n".join(["", ".. toctree::", "   :maxdepth: 1", "", *(f"   {c}" for c in children), ""])
    elif below:
        text += "\n".join(["", ".. rubric:: Modules", "", *(f"* :py:mod:`{m}`" for m in below), ""])
    for module in below:
        text += "\n" + module_section(module, entries[module], module.count(".") - page.count("."))
    return text


_ROLE = re.compile(r":(?:py:)?(\w+):`~?\.?(?:[^`<]*<)?([^`>]+)>?`")


def _role_text(match: re.Match) -> str:
    role, target = match.groups()
    return "``" + (target if role == "mod" else target.rpartition(".")[2]) + "``"


def summary(module: str, name: str) -> str:
    """The first sentence of the docstring of ``module.name`` as plain text with literals (no
    references: the summary table's page is not the module the docstring's names are relative to)."""
    value = getattr(sys.modules[module], name)
    doc = data_docs(module, name) if _kind(value) == "data" else inspect.getdoc(value)
    if not doc:
        return ""
    paragraph = " ".join(doc.split("\n\n")[0].split())
    sentence = _split_clauses(paragraph, stops=".")[0] if paragraph else ""
    text = _ROLE.sub(_role_text, sentence)
    text = re.sub(r"(?<!`)`([^`]+)`(?!`)", r"``\1``", text)  # default role -> literal
    return text


def write_api_pages(srcdir: pathlib.Path) -> list[str]:
    """Writes ``reference/api/<page>.rst`` for rljax and for each module or package directly in it
    (see :func:`page_of`); returns the names of every public module."""
    modules = public_modules()
    entries = reference_entries(modules)
    out = srcdir / API_DIR
    out.mkdir(parents=True, exist_ok=True)
    wanted = set()
    for name in sorted({page_of(m) for m in modules}):
        page = out / f"{name}.rst"
        wanted.add(page)
        text = api_page(name, modules, entries)
        if not page.exists() or page.read_text() != text:  # unchanged pages keep Sphinx's cache valid
            page.write_text(text)
    for stale in set(out.glob("*.rst")) - wanted:
        stale.unlink()
    return modules


def module_index(modules: list[str]) -> str:
    """The toctree of the reference's index: rljax's own page (whose tree holds every other)."""
    return "\n".join(["```{toctree}", ":maxdepth: 2", "", f"api/{PACKAGE}", "```", ""])


# -- the config reference --------------------------------------------------------------------------


def _section_class(hint: Any) -> type | None:
    """The dataclass of a field's type hint (``X`` or ``X | None``), else None."""
    if dataclasses.is_dataclass(hint):
        return hint
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(inner) == 1 and dataclasses.is_dataclass(inner[0]):
            return inner[0]
    return None


def format_type(hint: Any) -> str:
    """A type hint as it reads in the config: ``int``, ``float | None``, ``Mapping[str, str]``."""
    if hint is type(None):
        return "None"
    if hint is Any:
        return "any"
    if hint is Ellipsis:
        return "..."
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(format_type(a) for a in typing.get_args(hint))
    if origin is not None:
        args = ", ".join(format_type(a) for a in typing.get_args(hint))
        name = getattr(origin, "__name__", str(origin))
        return f"{name}[{args}]" if args else name
    return getattr(hint, "__name__", str(hint))


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


_ATTRIBUTES = re.compile(r"^Attributes:\n((?:[ \t]+\S.*\n?|\n(?=[ \t]+\S))+)", re.MULTILINE)


def _attribute_docs(cls: type) -> dict[str, str]:
    """Field -> text of the ``Attributes:`` blocks of ``cls`` and its bases (``a, b: text`` entries)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        doc = inspect.cleandoc(klass.__dict__.get("__doc__") or "")
        block = _ATTRIBUTES.search(doc)
        if not block:
            continue
        body = textwrap.dedent(block.group(1))
        for match in re.finditer(r"^([\w, ]+):\s(.*(?:\n[ \t]+.*)*)", body, re.MULTILINE):
            text = " ".join(match.group(2).split())
            for name in match.group(1).split(","):
                docs[name.strip()] = text
    return docs


def _comment_docs(cls: type) -> dict[str, str]:
    """Field -> its ``#:`` comment lines above it, or the ``#:`` comment ending its line (class body)."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass) or klass.__module__ == "builtins":
            continue
        try:
            source = textwrap.dedent(inspect.getsource(klass))
        except (OSError, TypeError):
            continue
        lines = source.splitlines()
        comments = {
            tok.start[0]: tok.string
            for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.COMMENT
        }
        body = ast.parse(source).body[0].body
        for node in body:
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            above, row = [], node.lineno - 1
            while row >= 1 and lines[row - 1].strip().startswith("#:"):
                above.insert(0, lines[row - 1].strip()[2:].strip())
                row -= 1
            trailing = comments.get(node.end_lineno, "")
            if above:
                docs[node.target.id] = " ".join(above)
            elif trailing.startswith("#:"):
                docs[node.target.id] = trailing[2:].strip()
    return docs


def _split_clauses(text: str, stops: str = ".") -> list[str]:
    """``text`` split after each of ``stops`` followed by a space, outside parentheses and literals."""
    clauses, depth, start, literal = [], 0, 0, False
    i = 0
    while i < len(text):
        if text.startswith("``", i):
            literal = not literal
            i += 2
            continue
        c = text[i]
        if not literal:
            depth += c in "([{"
            depth -= c in ")]}"
            abbreviation = re.search(r"\b(e\.g|i\.e|cf|vs|etc)$", text[start:i])
            if depth <= 0 and c in stops and (i + 1 == len(text) or text[i + 1] == " ") and not abbreviation:
                clauses.append(text[start : i + 1].strip())
                start = i + 1
                depth = 0
        i += 1
    if text[start:].strip():
        clauses.append(text[start:].strip())
    return clauses


def field_docs(cls: type) -> dict[str, str]:
    """Field -> its one-line meaning (see the module docstring for where it comes from)."""
    from rljax import knobs

    names = [f.name for f in dataclasses.fields(cls)]
    docs = _comment_docs(cls)
    docs.update(_attribute_docs(cls))
    docs.update({f.name: knobs.field_doc(f) for f in dataclasses.fields(cls) if knobs.knob_of(f)})
    return {n: docs[n] for n in names if n in docs}


@dataclasses.dataclass(frozen=True)
class ConfigKey:
    """One key of the run config."""

    path: str
    type: str
    default: Any
    doc: str


@dataclasses.dataclass(frozen=True)
class ConfigSection:
    """One section of the run config: its path, its class and its keys (subsections apart)."""

    path: str
    cls: type
    keys: list[ConfigKey]


def config_sections(cls: type | None = None, path: str = "config") -> Iterator[ConfigSection]:
    """The sections of the run config (``RunConfig`` first), depth first, each with its keys."""
    from rljax import knobs
    from rljax.run.config import NAMED_SECTIONS, RUN_SET_FIELDS, RunConfig

    cls = RunConfig if cls is None else cls
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    skip = set(RUN_SET_FIELDS.get(cls, ()))  # e.g. a frozen model's name: the mapping's key
    keys, subsections = [], []
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        key = f"{path}.{field.name}"
        sub = _section_class(hints[field.name])
        spec = knobs.knob_of(field)
        if spec is not None and spec.fields_of is not None:  # a mapping of that class's fields
            subsections.append((spec.fields_of, key))
        elif cls is RunConfig and field.name in NAMED_SECTIONS:  # name -> a section of that class
            subsections.append((NAMED_SECTIONS[field.name], f"{key}.<name>"))
        elif sub is not None:
            subsections.append((sub, key))
        doc = docs.get(field.name, "")
        keys.append(ConfigKey(key, format_type(hints[field.name]), _default(field), doc))
    yield ConfigSection(path, cls, keys)
    for sub, sub_path in subsections:
        yield from config_sections(sub, sub_path)


def _literal(text: str) -> str:
    return "``" + text.replace("``", "`\u200b`") + "``" if text else ""


_LONG_DEFAULT = 48  # characters: a longer default is printed below its section's table


def _default_text(key: ConfigKey, section: str | None) -> str:
    """The default column of ``key`` (``section``: the path of the section it holds, if any)."""
    if key.default is dataclasses.MISSING:
        return "required"
    if dataclasses.is_dataclass(key.default) and not isinstance(key.default, type) and section:
        return "see :ref:`" + section.replace("<", "\\<") + f" <{_anchor(section)}>`"
    text = repr(key.default)
    return "see below" if len(text) > _LONG_DEFAULT else _literal(text)


def _anchor(path: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", path.lower()).strip("-")


def _qualify_roles(text: str, cls: type) -> str:
    """``text`` with the bare ``:meth:``/``:attr:`` names of ``cls``'s members prefixed by the class
    (the config reference shows a section's docstring outside its class), every reference shown
    by its last name."""

    def qualify(match: re.Match) -> str:
        role, name = match.groups()
        if role in ("meth", "attr") and "." not in name and hasattr(cls, name):
            name = f"{cls.__qualname__}.{name}"
        return f":{role}:`~{name}`"  # short names: the tables are narrow

    return re.sub(r":(\w+):`~?([\w.]+)`", qualify, text)


def _section_intro(cls: type, napoleon_config: Any = None) -> str:
    """A section class's docstring less its examples and its ``Attributes:`` block (the table holds
    those), as reStructuredText (Google-style sections converted when ``napoleon_config`` is given)."""
    doc = inspect.getdoc(cls) or ""
    doc = re.split(r"^>>>", doc, maxsplit=1, flags=re.MULTILINE)[0]
    doc = _ATTRIBUTES.sub("", doc + "\n").strip()
    if doc and napoleon_config is not None:
        from sphinx.ext.napoleon.docstring import GoogleDocstring

        doc = str(GoogleDocstring(doc, napoleon_config, what="class")).strip()
    return _qualify_roles(doc, cls)


def config_reference(napoleon_config: Any = None) -> str:
    """The config reference's Markdown: one heading, docstring and table of keys per section."""
    sections = list(config_sections())
    paths = [s.path for s in sections]
    out = []
    for section in sections:
        ancestors = sum(section.path.startswith(p + ".") for p in paths)
        qualname = f"{section.cls.__module__}.{section.cls.__qualname__}"
        out += [f"({_anchor(section.path)})=", f"{'#' * min(2 + ancestors, 6)} `{section.path}`", ""]
        out += ["```{eval-rst}", f".. currentmodule:: {section.cls.__module__}", ""]
        out += [f"Class: :class:`~{qualname}`.", ""]
        doc = _section_intro(section.cls, napoleon_config)
        if doc:
            out += [doc, ""]
        out += [
            ".. list-table::",
            "   :header-rows: 1",
            "   :widths: 30 16 20 34",
            "   :class: config-keys",
            "",
        ]
        out += ["   * - key", "     - type", "     - default", "     - meaning"]
        long_defaults = []
        for key in section.keys:
            held = next((p for p in paths if p == key.path or p.startswith(key.path + ".<")), None)
            default = _default_text(key, held)
            if default == "see below":
                long_defaults.append(key)
            out += [f"   * - {_literal(key.path)}", f"     - {_literal(key.type)}", f"     - {default}"]
            out += [f"     - {_qualify_roles(key.doc, section.cls)}"]
        out.append("")
        for key in long_defaults:
            out += [f"Default of ``{key.path}``:", "", ".. code-block:: python", ""]
            out += [
                f"   {line}" for line in pprint.pformat(key.default, width=96, sort_dicts=False).splitlines()
            ]
            out.append("")
        out += ["```", ""]
    return "\n".join(out)


# -- docstring coverage ----------------------------------------------------------------------------


def attribute_docs(module: str) -> dict[str, str]:
    """Top-level name -> its documentation in ``module``'s source, as Sphinx's autodoc reads it: a
    ``#:`` comment above the assignment or ending its line, or a string literal right after it."""
    from sphinx.pycode import ModuleAnalyzer

    try:
        found = ModuleAnalyzer.for_module(module).find_attr_docs()
    except Exception:  # noqa: BLE001 (no source: nothing documented)
        return {}
    return {name: "\n".join(lines).strip() for (scope, name), lines in found.items() if not scope}


def data_docs(module: str, name: str) -> str:
    """The documentation of data ``module.name``: from ``module``'s source, else from the source of
    the rljax module that assigns the same object under that name (a package re-exports it)."""
    doc = attribute_docs(module).get(name, "")
    if doc:
        return doc
    value = getattr(sys.modules[module], name)
    for other, mod in sorted(sys.modules.items()):
        if other.partition(".")[0] != PACKAGE or other == module or mod is None:
            continue
        if getattr(mod, name, None) is value and name in _assigned_names(mod):
            return attribute_docs(other).get(name, "")
    return ""


def undocumented() -> list[str]:
    """Dotted paths of the public modules and (homed) public names that have no docstring."""
    modules = public_modules()
    missing = [m for m in modules if not (sys.modules[m].__doc__ or "").strip()]
    for module, entries in reference_entries(modules).items():
        for e in entries:
            if not e.is_home or not e.public:
                continue
            value = getattr(sys.modules[module], e.name)
            if e.kind == "data":
                if not data_docs(module, e.name):
                    missing.append(e.home)
            elif not (getattr(value, "__doc__", None) or "").strip():
                missing.append(e.home)
    return missing


# -- cross-references to re-exported names -------------------------------------------------------

_HOMES: dict[Any, str] = {}  # object_key -> where it is documented (filled when the build starts)
_BY_SHORT_NAME: dict[str, list[str]] = {}  # last part of a documented path -> the paths


def _object_at(path: str) -> tuple[Any, list[str]] | None:
    """The object at dotted ``path`` (its longest importable module prefix, then attributes) and the
    chain of objects' names walked, or None when nothing is there."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        module = sys.modules.get(".".join(parts[:i]))
        if module is None:
            continue
        chain = [module]
        for part in parts[i:]:
            try:
                chain.append(getattr(chain[-1], part))
            except Exception:  # noqa: BLE001 (any failing attribute means: not there)
                return None
        return chain[-1], chain
    return None


def _documented_target(path: str, chain: list[Any]) -> tuple[str, bool] | None:
    """The documented name that dotted ``path`` (with its walked ``chain`` of objects) denotes, and
    whether it is an external object (outside rljax: shown as text, not linked)."""
    parts = path.split(".")
    offset = len(parts) - len(chain) + 1  # chain[0] is the module named by parts[:offset]
    for i in range(len(chain) - 1, 0, -1):
        home = _HOMES.get(object_key(chain[i], parts[offset + i - 1]))
        if home is not None:
            return ".".join([home, *parts[offset + i :]]), False
    obj = chain[-1]
    if isinstance(obj, types.ModuleType):
        owner = obj.__name__
    elif inspect.isclass(obj) or inspect.isroutine(obj):
        owner = getattr(obj, "__module__", None) or ""
    else:  # data: the module it was reached through
        owner = next(o.__name__ for o in reversed(chain) if isinstance(o, types.ModuleType))
    if owner.partition(".")[0] != PACKAGE:
        return path, True
    return None


def _private(obj: Any, path: str) -> bool:
    """An implementation detail that signatures or docstrings may name but the reference does not
    document: a name with a ``_`` part, or a type variable."""
    return isinstance(obj, typing.TypeVar) or any(p.startswith("_") for p in path.split("."))


def _has_attribute(cls: type, name: str) -> bool:
    """Whether instances of ``cls`` have attribute ``name``: a field, an annotation, or an
    assignment ``self.<name> = ...`` in the source of the class or a base."""
    for klass in cls.__mro__:
        if name in getattr(klass, "__annotations__", {}) or name in vars(klass):
            return True
        if name in _assigned_attributes(klass):
            return True
    return False


@functools.cache
def _assigned_attributes(klass: type) -> frozenset[str]:
    """The names ``self.<name> = ...`` (or ``self.<name>: T = ...``) assigns in the source of
    ``klass`` (read once per class: a build resolves thousands of references)."""
    try:
        source = inspect.getsource(klass)
    except (OSError, TypeError):
        return frozenset()
    return frozenset(re.findall(r"\bself\.(\w+)(?=\s*(?::[^=]+)?=)", source))


def _on_missing_reference(app: Any, env: Any, node: Any, contnode: Any) -> Any:
    """Resolves a Python reference that names an rljax object by another path than where it is
    documented (a package's re-export, a module alias such as ``jnp.dtype``, a name relative to the
    current module or class, a name imported for type checking only): links to the documented
    object, or to the documented class of an attribute that has no entry of its own. An object of
    another package or a private one is shown as text. Anything else stays unresolved (and fails
    the build)."""
    if node.get("refdomain") != "py":
        return None
    target = node["reftarget"].lstrip("~.")
    module, cls = node.get("py:module"), node.get("py:class")
    candidates = [f"{module}.{cls}.{target}"] if module and cls else []
    candidates += [f"{module}.{target}"] if module else []
    candidates.append(target)
    domain = env.get_domain("py")

    def link(name: str, reftype: str) -> Any:
        return domain.resolve_xref(env, node["refdoc"], app.builder, reftype, name, node, contnode)

    found = next(((c, f) for c in candidates if (f := _object_at(c)) is not None), None)
    if found is None:
        for candidate in candidates:  # an attribute of instances, described by its class
            owner, _, name = candidate.rpartition(".")
            parent = _object_at(owner) if owner else None
            home = _HOMES.get(id(parent[0])) if parent and inspect.isclass(parent[0]) else None
            if home and inspect.isclass(parent[0]) and _has_attribute(parent[0], name):
                return link(home, "class")
        head, dot, tail = target.partition(".")  # "Name" or "Name.attr" of a unique documented Name
        short = _BY_SHORT_NAME.get(head, [])
        if len(short) != 1:
            return None
        path = short[0] + dot + tail
        found = (path, _object_at(path))
        if found[1] is None:
            return None
    path, (obj, chain) = found
    if _private(obj, path):
        return contnode
    resolved = _documented_target(path, chain)
    if resolved is None:
        return None
    new_target, external = resolved
    if external:
        return contnode
    if new_target in domain.objects:
        return link(new_target, node["reftype"])
    owner = new_target.rpartition(".")[0]  # an attribute without an entry: its class
    if owner in domain.objects and domain.objects[owner].objtype in ("class", "exception"):
        return link(owner, "class")
    return None


# -- Google-style docstrings ------------------------------------------------------------------------


def _napoleon_docstring(app: Any, what: str, name: str, obj: Any, options: Any, lines: list[str]) -> None:
    """Napoleon's conversion of Google-style sections, except on data, attributes and properties:
    there it reads a first line ``text: more text`` as ``type: description`` and turns the prose
    before the colon into a class reference (rljax documents such names in prose)."""
    from sphinx.ext import napoleon

    if what in ("data", "attribute") and not (inspect.isclass(obj) or inspect.isroutine(obj)):
        if "\n".join(lines).strip() == (inspect.getdoc(type(obj)) or "").strip():
            lines[:] = []  # a value without docs shows no docstring, not its type's (dict's, ...)
    if what in ("data", "attribute", "property"):
        return
    napoleon._process_docstring(app, what, name, obj, options, lines)
    for i in reversed(range(len(lines))):  # "a, b: text" documents several attributes: no one target
        match = re.match(r"^(\s*)\.\. attribute:: .*,", lines[i])
        if match:
            lines.insert(i + 1, f"{match.group(1)}   :no-index:")


def _factory_defaults(
    app: Any,
    what: str,
    name: str,
    obj: Any,
    options: Any,
    signature: str | None,
    return_annotation: str | None,
) -> tuple[str | None, str | None] | None:
    """A dataclass's signature with each ``<factory>`` default (not Python: the signature would not
    parse) replaced by the value its factory makes, or ``...`` when that is long."""
    if not signature or "<factory>" not in signature or not dataclasses.is_dataclass(obj):
        return None
    for field in dataclasses.fields(obj):
        if field.init and field.default_factory is not dataclasses.MISSING:
            text = repr(field.default_factory())
            text = text if len(text) <= 40 else "..."
            signature = signature.replace("<factory>", text, 1)
    return signature, return_annotation


def _skip_tuple_fields(app: Any, what: str, name: str, obj: Any, skip: bool, options: Any) -> bool | None:
    """Skips a NamedTuple's generated field accessors ("Alias for field number N"): the class's
    ``Attributes:`` block describes its fields."""
    if what == "class" and (getattr(obj, "__doc__", None) or "").startswith("Alias for field number"):
        return True
    return None


def _setup_napoleon(app: Any) -> None:
    from sphinx.ext import napoleon

    app.setup_extension("sphinx.ext.napoleon")
    listeners = app.events.listeners["autodoc-process-docstring"]
    listeners[:] = [item for item in listeners if item.handler is not napoleon._process_docstring]
    app.connect("autodoc-process-docstring", _napoleon_docstring)
    app.connect("autodoc-process-signature", _factory_defaults)
    app.connect("autodoc-skip-member", _skip_tuple_fields)


# -- the Sphinx extension --------------------------------------------------------------------------


def _on_builder_inited(app: Any) -> None:
    app.env.rljax_modules = write_api_pages(pathlib.Path(app.srcdir))
    for entries in reference_entries(app.env.rljax_modules).values():
        for e in entries:
            _HOMES.setdefault(object_key(getattr(sys.modules[e.module], e.name), e.name), e.home)
    for home in sorted(set(_HOMES.values())):
        _BY_SHORT_NAME.setdefault(home.rpartition(".")[2], []).append(home)


def _on_source_read(app: Any, docname: str, source: list[str]) -> None:
    if CONFIG_MARKER in source[0]:
        source[0] = source[0].replace(CONFIG_MARKER, config_reference(app.config))
        for section in config_sections():  # an incremental build re-reads the page when they change
            app.env.note_dependency(inspect.getsourcefile(section.cls))
    if INDEX_MARKER in source[0]:
        source[0] = source[0].replace(INDEX_MARKER, module_index(getattr(app.env, "rljax_modules", [])))


def _indexed_python_domain() -> type:
    """Sphinx's Python domain, answering its hopeless fuzzy lookups from an index.

    A type in a signature is a reference Sphinx resolves with a fuzzy search when the name is not
    found as given: every documented object is tested for ending in ``.name``. Nearly all such
    names are other packages' (``str``, ``numpy.ndarray``, ``jax.Array``), found nowhere, and the
    scans cost a third of the build without notebooks (about 22,000 scans of every object). This
    domain keeps the set of every object name's dotted suffixes and returns no match at once where
    neither the name nor any ``*.name`` is documented (then no branch of the lookup can match);
    every other lookup is Sphinx's own. Unresolved references go on to the ``missing-reference``
    handlers and the nitpicky checks as before.
    """
    from sphinx.domains.python import PythonDomain

    class IndexedPythonDomain(PythonDomain):
        _suffixes: tuple[int, frozenset[str]] = (-1, frozenset())

        def _documented_suffixes(self) -> frozenset[str]:
            """Every ``b.c`` and ``c`` of each documented ``a.b.c``; rebuilt when objects are added."""
            count, suffixes = self._suffixes
            if count != len(self.objects):
                parts = (name.split(".") for name in self.objects)
                suffixes = frozenset(".".join(p[i:]) for p in parts for i in range(1, len(p)))
                self._suffixes = (len(self.objects), suffixes)
            return suffixes

        def find_obj(self, env, modname, classname, name, type, searchmode=0):  # noqa: A002 - Sphinx's
            bare = name.removesuffix("()")
            if searchmode == 1 and bare not in self.objects and bare not in self._documented_suffixes():
                return []
            return super().find_obj(env, modname, classname, name, type, searchmode)

    return IndexedPythonDomain


def setup(app: Any) -> dict[str, Any]:
    """Registers the generation of the API pages and of the config reference."""
    _setup_napoleon(app)
    app.add_domain(_indexed_python_domain(), override=True)
    app.connect("builder-inited", _on_builder_inited)
    app.connect("source-read", _on_source_read)
    app.connect("missing-reference", _on_missing_reference)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}


if __name__ == "__main__":
    print(config_reference())
    missing = undocumented()
    print(f"\n{len(missing)} public names without a docstring", *missing, sep="\n", file=sys.stderr)

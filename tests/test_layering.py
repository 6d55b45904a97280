"""The package's import structure: layers only import downward, and no module imports itself back.

Checked statically from the source (``ast``), counting imports inside functions too (a lazy
import is still a dependency). The layers are :data:`LAYERS` (the package) and :data:`TOP_LEVEL`
(the repository's ``configs/`` and ``launch/``, above the package); design §1 shows them as the
diagram :func:`diagram` draws (``python tests/test_layering.py`` prints it, and a test keeps
docs/design.md equal to it).

A module may import any module of its own layer or a lower one; the module graph must be acyclic.
The launch scripts are thin: from rljax they import only :data:`LAUNCH_MAY_IMPORT`.
"""

from __future__ import annotations

import ast
import functools
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
ROOT = REPO / "rljax"
DESIGN = REPO / "docs" / "design.md"

LAYERS: dict[str, int] = {
    "rljax.types": 0,
    "rljax.knobs": 0,
    "rljax.progress": 0,
    "rljax.extras": 0,
    "rljax.core": 1,
    "rljax.algorithms": 2,
    "rljax.data": 3,
    "rljax.chat": 3,
    "rljax.envs": 3,
    "rljax.models": 4,
    "rljax.inference": 5,
    "rljax.rollout": 6,
    "rljax.recording": 6,
    "rljax.evaluation": 6,
    "rljax.gateway": 6,
    "rljax.report": 6,
    "rljax.training": 7,
    "rljax.agents": 7,
    "rljax.run": 8,
    "rljax.tinker": 9,
    "rljax.cli": 10,
    "rljax.recipes": 10,
    "rljax.__main__": 10,
}

#: The repository's top-level directories of Python files, above the package: the config files users
#: run and copy (imported as ``rljax.recipes``) and the launch scripts and cluster templates.
TOP_LEVEL: dict[str, int] = {"configs": 11, "launch": 11}

#: What a launch script may import from rljax: the command line's entry point, nothing else.
LAUNCH_MAY_IMPORT = {"rljax.cli.main"}


def _module_name(path: pathlib.Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _layer(module: str) -> int | None:
    best = None
    for prefix, layer in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            best = layer
    return best


@functools.cache
def _tree(path: pathlib.Path) -> ast.Module:
    """``path`` parsed (once per session: every test here walks the same files)."""
    return ast.parse(path.read_text())


def _imports(path: pathlib.Path, known: set[str]) -> set[str]:
    """The rljax modules ``path`` imports (resolved to the most specific known module)."""
    out: set[str] = set()
    tree = _tree(path)
    type_only = set()  # `if TYPE_CHECKING:` blocks are not run
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            type_only.update(id(n) for b in node.body for n in ast.walk(b))
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" for a in node.names]  # `from pkg import submodule`
            if not any(n in known for n in names):
                names = [node.module]
        for name in names:
            if not name.startswith("rljax"):
                continue
            while name and name not in known:  # `from rljax.data import StepBatch` -> rljax.data
                name = name.rpartition(".")[0]
            if name:
                out.add(name)
    return out


@functools.cache
def _graph() -> dict[str, set[str]]:
    mods = _modules()
    known = set(mods)
    graph = {}
    for name, path in mods.items():
        graph[name] = _imports(path, known) - {name}
    return graph


def test_every_module_has_a_layer():
    missing = sorted(m for m in _modules() if m != "rljax" and _layer(m) is None)
    assert not missing, f"modules outside the layer table: {missing}"


def test_imports_point_down():
    bad = []
    for mod, deps in _graph().items():
        if mod == "rljax":
            continue
        for dep in deps:
            if dep == "rljax":
                bad.append(f"{mod} imports the rljax package root")
                continue
            if _layer(dep) > _layer(mod):
                bad.append(f"{mod} (layer {_layer(mod)}) imports {dep} (layer {_layer(dep)})")
    assert not bad, "upward imports:\n" + "\n".join(sorted(bad))


def test_no_import_cycles():
    graph = _graph()
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_types_imports_nothing_from_rljax():
    assert _imports(ROOT / "types.py", set(_modules())) == set()


#: What the pure functions of ``rljax.core`` may import from the rest of rljax: the records and the
#: declaration of config knobs (plain Python, no I/O).
CORE_MAY_IMPORT = {"rljax.types", "rljax.knobs"}


@pytest.mark.parametrize("mod", ["rljax.core"])
def test_core_imports_only_types(mod):
    graph = _graph()
    for name, deps in graph.items():
        if name == mod or name.startswith(mod + "."):
            outside = {
                d for d in deps if not (d == mod or d.startswith(mod + ".")) and d not in CORE_MAY_IMPORT
            }
            assert not outside, f"{name} imports {outside}"


def _top_level_files(directory: str) -> list[pathlib.Path]:
    return sorted((REPO / directory).rglob("*.py"))


def test_top_level_directories_import_only_downward():
    known = set(_modules())
    assert len(_top_level_files("configs")) >= 10 and len(_top_level_files("launch")) >= 4
    bad = []
    for directory, layer in TOP_LEVEL.items():
        for path in _top_level_files(directory):
            for dep in _imports(path, known):
                if dep == "rljax" or _layer(dep) > layer:
                    bad.append(f"{path.relative_to(REPO)} imports {dep}")
    assert not bad, "\n".join(bad)


def test_launch_scripts_are_thin():
    """A launch script runs an rljax command; its work is the command's (no logic of its own)."""
    known = set(_modules())
    for path in _top_level_files("launch"):
        extra = _imports(path, known) - LAUNCH_MAY_IMPORT
        assert not extra, f"{path.relative_to(REPO)} imports {sorted(extra)}"


def test_the_package_does_not_import_configs_or_launch():
    """The package reaches the configs only through rljax.recipes (a path, not an import)."""
    for path in sorted(ROOT.rglob("*.py")):
        for node in ast.walk(_tree(path)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            assert not [n for n in names if n.split(".")[0] in TOP_LEVEL], path


def diagram(width: int = 100) -> str:
    """The layers as design §1 draws them: each layer's names, lowest first, joined by ``<-``."""
    by_layer: dict[int, list[str]] = {}
    for name, layer in LAYERS.items():
        short = name.removeprefix("rljax.")
        if short != "__main__":
            by_layer.setdefault(layer, []).append(short)
    for name, layer in TOP_LEVEL.items():
        by_layer.setdefault(layer, []).append(f"{name}/")
    groups = [", ".join(by_layer[layer]) for layer in sorted(by_layer)]
    lines, line = [], groups[0]
    for group in groups[1:]:
        if len(line) + len(group) + 6 > width:
            lines.append(line)
            line = f"    <-  {group}"
        else:
            line += f"  <-  {group}"
    return "\n".join([*lines, line])


def test_the_design_diagram_is_the_layering_rules():
    text = DESIGN.read_text()
    opening = text.index("```\n", text.index("The package, by layer")) + 4
    block = text[opening : text.index("\n```", opening)]
    assert block == diagram(), f"docs/design.md §1's layer diagram should read:\n{diagram()}"


if __name__ == "__main__":
    print(diagram())

"""The package's import structure: layers only import downward, and no module imports itself back.

Checked statically from the source (``ast``), counting imports inside functions too (a lazy
import is still a dependency):

    types, progress, extras  <-  core  <-  algorithms  <-  data, chat, envs  <-  models  <-  inference
        <-  rollout, recording, evaluation, gateway, report  <-  training, agents  <-  run  <-  tinker
        <-  cli, recipes

A module may import any module of its own layer or a lower one; the module graph must be acyclic.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "rljax"

LAYERS: dict[str, int] = {
    "rljax.types": 0,
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


def _imports(path: pathlib.Path, known: set[str]) -> set[str]:
    """The rljax modules ``path`` imports (resolved to the most specific known module)."""
    out: set[str] = set()
    tree = ast.parse(path.read_text())
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


@pytest.mark.parametrize("mod", ["rljax.core"])
def test_core_imports_only_types(mod):
    graph = _graph()
    for name, deps in graph.items():
        if name == mod or name.startswith(mod + "."):
            outside = {d for d in deps if not (d == mod or d.startswith(mod + ".")) and d != "rljax.types"}
            assert not outside, f"{name} imports {outside}"

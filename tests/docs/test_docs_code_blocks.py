"""The documentation's Python examples run, and its relative links point at files that exist.

Every fenced ```` ```python ```` block of README.md, docs/*.md and docs/guides/*.md is executed, in page
order, in one namespace per page (a later block may use names an earlier one defined), from a
temporary working directory. A block whose first line is ``# not run`` is skipped: the convention for
the few examples that need a real vLLM server, a GPU or a network service; they are shown, not run.
Shell, YAML and text blocks are never run.

Blocks are compiled with their page's file name and line numbers, so a failing example's traceback
points at the line of the page.
"""

from __future__ import annotations

import contextlib
import pathlib
import re

import pytest
from smollm2 import real_model_slot

ROOT = pathlib.Path(__file__).resolve().parents[2]
NOT_RUN = "# not run"

#: README first, then the docs pages and guides in name order.
PAGES = [
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted((ROOT / "docs" / "guides").glob("*.md")),
]

_FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^\n`]*)$")


def _closes(match: re.Match, fence: str) -> bool:
    """Whether a fence line closes a block opened by ``fence``: same character, no shorter, no info."""
    return match["fence"][0] == fence[0] and len(match["fence"]) >= len(fence) and not match["info"].strip()


def code_blocks(text: str) -> list[tuple[str, int, str]]:
    """``(language, first code line number, code)`` of every fenced block of ``text``, in order.

    The language is the first word of the fence's info string (``""`` when there is none); line
    numbers count from 1. A fence closes with the same character, at least as long, and no info.
    """
    blocks: list[tuple[str, int, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        opening = _FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        fence, info = opening["fence"], opening["info"].strip()
        body, j = [], i + 1
        while j < len(lines):
            closing = _FENCE.match(lines[j])
            if closing and _closes(closing, fence):
                break
            body.append(lines[j])
            j += 1
        language = info.split()[0] if info else ""
        blocks.append((language, i + 2, "\n".join(body) + "\n"))
        i = j + 1
    return blocks


def runnable_blocks(text: str) -> list[tuple[int, str]]:
    """``(line number, code)`` of the ```` ```python ```` blocks that the test runs (not ``# not run``)."""
    return [
        (line, code)
        for language, line, code in code_blocks(text)
        if language == "python" and not code.lstrip().startswith(NOT_RUN)
    ]


def test_code_blocks_parser_keeps_languages_lines_and_the_not_run_convention() -> None:
    page = "\n".join([
        "# Title",                       # 1
        "```python",                     # 2
        "x = 1",                         # 3
        "```",                           # 4
        "```bash",                       # 5
        "rljax train --config=smoke",    # 6
        "```",                           # 7
        "````python",                    # 8
        "# not run: needs a GPU",        # 9
        "```",                           # 10 (inside: a shorter fence does not close it)
        "````",                          # 11
        "```python",                     # 12
        "y = x + 1",                     # 13
        "```",                           # 14
    ])  # fmt: skip
    blocks = code_blocks(page)
    languages_and_lines = [(lang, line) for lang, line, _ in blocks]
    assert languages_and_lines == [("python", 3), ("bash", 6), ("python", 9), ("python", 13)]
    assert blocks[2][2] == "# not run: needs a GPU\n```\n"
    assert runnable_blocks(page) == [(3, "x = 1\n"), (13, "y = x + 1\n")]


def test_the_pages_are_found() -> None:
    names = {p.relative_to(ROOT).as_posix() for p in PAGES}
    for must in ("README.md", "docs/getting_started.md", "docs/concepts.md", "docs/guides/agents.md"):
        assert must in names, f"{must} is not among the pages the test runs"


def _page_id(page: pathlib.Path) -> str:
    return page.relative_to(ROOT).as_posix()


@pytest.mark.parametrize("page", [p for p in PAGES if runnable_blocks(p.read_text())], ids=_page_id)
def test_page_python_blocks_run(
    page: pathlib.Path, tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": f"docs_page_{page.stem}"}
    # a page that trains the real SmolLM2 takes the lock its other tests take (tests/smollm2.py)
    blocks = runnable_blocks(page.read_text())
    real_model = any("smollm2_base" in code for _, code in blocks)
    with real_model_slot() if real_model else contextlib.nullcontext():
        for line, code in blocks:
            # pad with newlines so tracebacks show the page's own line numbers
            exec(compile("\n" * (line - 1) + code, str(page), "exec"), namespace)  # noqa: S102


_LINK = re.compile(r"\]\((?P<target>[^)\s]+)(?:\s+\"[^\"]*\")?\)")


def relative_links(text: str) -> list[str]:
    """Targets of the Markdown links and images of ``text`` that point into the repository
    (no scheme, no pure ``#anchor``), without their ``#anchor``; code blocks are left out."""
    prose = text
    for _, _, code in code_blocks(text):
        prose = prose.replace(code, "")
    targets = []
    for match in _LINK.finditer(prose):
        target = match["target"]
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def test_relative_links_parser() -> None:
    text = (
        "[a](guides/lora.md) [b](https://x.org/y) [c](#top) "
        '![d](figures/f.svg "t") [e](design.md#2-data-model)'
    )
    assert relative_links(text) == ["guides/lora.md", "figures/f.svg", "design.md"]


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_relative_links_point_at_files(page: pathlib.Path) -> None:
    missing = [t for t in relative_links(page.read_text()) if not (page.parent / t).exists()]
    assert not missing, f"{_page_id(page)} links to files that do not exist: {missing}"

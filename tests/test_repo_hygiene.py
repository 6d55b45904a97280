"""Every tracked text file describes the product: no numbered labels of how it was built, no
citations of a document that is not in the repository.

Every tracked text file (``git ls-files``) is scanned for

* numbered labels: one of the words of :data:`WORK_LABEL` followed by a number (an upstream
  tracker reference such as "SkyRL issue #1492" carries a ``#`` and is not a label);
* citations of the specification document that lived outside the repository (its file name, or its
  section sign): the design is ``docs/design.md``, cited as "design §N".

The few places where such words have their ordinary product meaning are listed in ``ALLOWED`` with
the exact text, and each listed text must still be present, so the list cannot go stale silently.
"""

from __future__ import annotations

import pathlib
import re
import subprocess

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: ``<word> <number>`` with word issue / item / round / session (plural too), any case.
WORK_LABEL = re.compile(r"\b(?:issue|item|round|session)s?\s+\d+", re.IGNORECASE)
#: The outside spec by name: its file name, its section sign, or a bare "<name> 2.5" section number.
OUTSIDE_SPEC = re.compile(r"\bspec(?:\.md\b|\s*§|\s+\d+\.\d)", re.IGNORECASE)

#: path -> texts that mark a flagged line of that file as product wording (each must still be there).
ALLOWED: dict[str, tuple[str, ...]] = {
    # DynamicSampler's error names the sampling round a prompt was drawn in.
    "tests/data/test_data_filters.py": ("was already sampled in round ",),
}


def find_labels(text: str) -> list[tuple[int, str]]:
    """``(line number, line)`` of every line of ``text`` holding a work label or an outside-spec citation."""
    hits = []
    for number, line in enumerate(text.splitlines(), start=1):
        if WORK_LABEL.search(line) or OUTSIDE_SPEC.search(line):
            hits.append((number, line.strip()))
    return hits


def _tracked_text_files() -> dict[str, str]:
    """Tracked path -> its text, for every tracked file that is UTF-8 text (binaries are left out)."""
    listing = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    texts = {}
    for path in filter(None, listing.split("\0")):
        file = ROOT / path
        if not file.is_file():  # deleted in the work tree, or a submodule
            continue
        data = file.read_bytes()
        if b"\0" in data:
            continue
        try:
            texts[path] = data.decode("utf-8")
        except UnicodeDecodeError:
            continue
    return texts


def test_the_patterns_catch_labels_and_spare_product_words() -> None:
    # Built at run time, so this file never holds a label itself.
    number = str(6 * 7)
    planted = [
        "Benchmark (" + "iss" + "ue " + number + "): what a call costs",
        "see " + "Iss" + "ue " + number + " it" + "em " + str(5),
        "measured in " + "sess" + "ion " + number,
        "the figures of " + "rou" + "nd " + number,
        "Named algorithms (" + "SP" + "EC §3.6)",
        "The contract is " + "SP" + "EC.md",
        "Reference merge (" + "SP" + "EC 2.5, linear case)",
    ]
    for line in planted:
        assert find_labels(line) == [(1, line)], line
    product = [
        "regression against SkyRL issue #1492, where earlier steps received the last row",
        "10 rounds of forward_backward + optim_step compile nothing",
        "tests/conftest.py gives each session one persistent compilation cache",
        "work items (48-row tile x 4 panels) are shared with the thread pool",
        "python benchmarks/tunix_peer.py --spec SPEC.json",
        "the reward_spec of each row; model_spec(config)",
        "code comments cite it as design §3.6",
    ]
    for line in product:
        assert find_labels(line) == [], line


def test_tracked_files_carry_no_work_labels_or_outside_spec_citations() -> None:
    texts = _tracked_text_files()
    # Not vacuous: the listing found the repository's files, this one and the documents among them.
    assert len(texts) >= 150, f"only {len(texts)} tracked text files found under {ROOT}"
    for must in ("README.md", "docs/design.md", "rljax/core/objective.py", "tests/test_repo_hygiene.py"):
        assert must in texts, f"{must} was not scanned"

    found = []
    for path, text in sorted(texts.items()):
        allowed = ALLOWED.get(path, ())
        for allowed_text in allowed:
            assert allowed_text in text, f"{path}: {allowed_text!r} is gone; drop it from ALLOWED"
        found += [
            f"{path}:{number}: {line}"
            for number, line in find_labels(text)
            if not any(a in line for a in allowed)
        ]
    assert not found, (
        "work-item labels or outside-spec citations (the repo speaks of the product only; cite the "
        "design as 'design §N'):\n" + "\n".join(found)
    )

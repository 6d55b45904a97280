"""Executes the notebooks of docs/notebooks/ end to end; any failing cell fails the test.

The docs build executes them too; this test keeps them working without building the docs. A cell
may take minutes: tiny_agent.ipynb trains the default recipe's agent (its warm start and its first
step's compilation dominate), so the per-cell limit is generous.
"""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "docs" / "notebooks").glob("*.ipynb"))
CELL_TIMEOUT_S = 1200


@pytest.mark.subprocess  # a Jupyter kernel per notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path: pathlib.Path) -> None:
    nb = nbformat.read(path, as_version=4)
    resources = {"metadata": {"path": str(path.parent)}}
    NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3", resources=resources).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]


def test_the_notebooks_are_there() -> None:
    assert {p.name for p in NOTEBOOKS} == {"advantages.ipynb", "tiny_agent.ipynb"}

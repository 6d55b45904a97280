"""Executes the notebooks end to end; any failing cell fails the test."""

import pathlib

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


@pytest.mark.subprocess  # a Jupyter kernel per notebook
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.name for p in NOTEBOOKS])
def test_notebook_executes(path: pathlib.Path) -> None:
    nb = nbformat.read(path, as_version=4)
    resources = {"metadata": {"path": str(path.parent)}}
    NotebookClient(nb, timeout=300, kernel_name="python3", resources=resources).execute()
    outputs = [o for cell in nb.cells if cell.cell_type == "code" for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]


def test_there_is_a_notebook() -> None:
    assert any(p.name == "advantages.ipynb" for p in NOTEBOOKS)

"""The notebooks of docs/notebooks/.

The docs build executes every notebook (``nb_execution_mode = "force"``, a failing cell fails the
build: tests/docs/test_docs_build.py, which also checks they produced output), so they are not
executed a second time here.
"""

import pathlib

import nbformat

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "docs" / "notebooks").glob("*.ipynb"))


def test_the_notebooks_are_there_and_valid() -> None:
    assert {p.name for p in NOTEBOOKS} == {"advantages.ipynb", "tiny_agent.ipynb"}
    for path in NOTEBOOKS:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        assert sum(cell.cell_type == "code" for cell in nb.cells) >= 3, path.name

"""The shipped notebook is valid nbformat-4 JSON whose code cells parse and use real APIs."""

import ast
import json
import pathlib

NOTEBOOK = pathlib.Path(__file__).parents[1] / "notebooks" / "quickstart.ipynb"


def test_notebook_cells_parse_and_import_existing_names():
    nb = json.loads(NOTEBOOK.read_text())
    assert nb["nbformat"] == 4
    code = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    assert len(code) >= 3
    imported = []
    for src in code:
        tree = ast.parse(src)
        imported += [(n.module, a.name) for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
                     for a in n.names]
    for module, name in imported:
        assert hasattr(__import__(module, fromlist=[name]), name), f"{module}.{name}"

"""The shipped notebook is valid nbformat-4 JSON whose code cells parse and use real APIs."""

import ast
import json
import pathlib

import pytest

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


@pytest.mark.slow
def test_notebook_cells_run_on_a_tiny_config(tmp_path):
    """Executes every code cell with each get_config() shrunk to a 2-round, 6-client digits
    run; a cell that raises fails the test."""
    nb = _run_tiny(NOTEBOOK, tmp_path, {})
    results = nb.cells[-1].outputs[0]["data"]["text/plain"]
    assert all(f"{lam}:" in results for lam in (0.1, 0.5, 2.0)), results
    assert (tmp_path / "runs" / "notebook" / "metrics.jsonl").exists()


OWN = pathlib.Path(__file__).parents[1] / "notebooks" / "own_model_and_data.ipynb"


@pytest.mark.slow
def test_own_model_and_data_notebook_runs(tmp_path):
    """pFedES on the notebook's own Flax module and arrays (2 rounds), then Standalone."""
    nb = _run_tiny(OWN, tmp_path, {"ROUNDS = 20": "ROUNDS = 2"})
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.get("outputs", []))
    assert "personalized accuracy by architecture: {'my_cnn':" in text, text
    assert "standalone: mean personalized accuracy" in text, text
    assert (tmp_path / "runs" / "own_model_and_data" / "metrics.jsonl").exists()


COLAB = pathlib.Path(__file__).parents[1] / "notebooks" / "colab_tpu.ipynb"


@pytest.mark.slow
def test_colab_notebook_runs_on_a_tiny_config(tmp_path):
    """The Colab notebook (install skipped: the package is importable here) on a 2-round digits
    config: the shard-strategy quick start and the vectorized lambda sweep both finish."""
    assert "%pip install" in COLAB.read_text()
    nb = _run_tiny(COLAB, tmp_path, {"ROUNDS = 10": "ROUNDS = 2"})
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.get("outputs", []))
    assert "strategy shard" in text and "mesh axes: {'clients':" in text
    assert all(f"lam={lam}:" in text for lam in ("0.1", "0.5", "1", "2")), text
    assert (tmp_path / "runs" / "colab_sweep" / "lam=2" / "metrics.jsonl").exists()


def _run_tiny(path: pathlib.Path, tmp_path, replacements: dict[str, str]):
    """Executes the notebook at `path` (nbclient, a real kernel) with every
    `quickstart.get_config()` shrunk to a 6-client digits MLP run and the given source
    replacements; returns the executed notebook (a cell that raises fails the test)."""
    import nbclient
    import nbformat

    nb = nbformat.reads(path.read_text(), as_version=4)
    shrink = nbformat.v4.new_code_cell(
        "import sys\n"
        f"sys.path.insert(0, {str(path.parents[1])!r})\n"
        "def _tiny(config):\n"
        "    config.data.name = 'digits'; config.data.num_clients = 6\n"
        "    config.data.min_samples_per_client = 30; config.clients.architectures = 'mlp'\n"
        "    config.proxy_arch = 'proxy_mlp'; config.proxy_dim = 16\n"
        "    config.train.rounds = 2; config.eval.every = 1; config.checkpoint.every = 0\n"
        "    return config\n")
    replacements = {"quickstart.get_config()": "_tiny(quickstart.get_config())", **replacements}
    for cell in nb.cells:
        if cell.cell_type == "code":
            for old, new in replacements.items():
                cell.source = cell.source.replace(old, new)
    nb.cells.insert(0, shrink)
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    return nb

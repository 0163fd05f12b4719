"""The API reference (mkdocs.yml, docs/api/) builds from the docstrings with warnings as errors,
offline, and documents every module of the package."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.slow  # a process
def test_the_api_reference_builds_strictly_and_documents_every_module(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    pages = "\n".join(p.read_text() for p in tmp_path.rglob("index.html"))
    missing = []
    for path in sorted((ROOT / "fedjax_pfedes").rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        if f'id="{".".join(parts)}"' not in pages:
            missing.append(".".join(parts))
    assert missing == []
    public = (tmp_path / "index.html").read_text()
    for name in ("fedjax_pfedes.run", "fedjax_pfedes.register_algorithm",
                 "fedjax_pfedes.default_config"):
        assert f'id="{name}"' in public, name

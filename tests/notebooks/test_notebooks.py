"""Every notebook in notebooks/ runs top to bottom on CPU (what nbmake does, via nbclient), and is
committed without outputs. The exercise notebooks (notebooks/exercises/) have their own tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_committed_without_outputs(path):
    nb = nbformat.read(path, as_version=4)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.get("outputs") or c.get("execution_count"))]
    assert not dirty, f"{path.name}: cells {dirty} have outputs; clear them before committing"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, monkeypatch):
    from nbclient import NotebookClient

    # The kernel inherits the environment: one thread per kernel, the Triton interpreter on CPU.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("TRITON_INTERPRET", os.environ.get("TRITON_INTERPRET", "1"))
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"])
    monkeypatch.setenv("LABKIT_INJECT_SOLUTIONS", "1")  # quiz answers = labkit's truth; strict
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=240, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors
    # every plotly figure cell produced a figure or widget, not just text
    shown = [o for c in nb.cells if c.cell_type == "code" and "fig.show()" in c.source
             for o in c.get("outputs", []) if o.get("output_type") == "display_data"]
    want = sum(1 for c in nb.cells if c.cell_type == "code" and "fig.show()" in c.source)
    assert len(shown) >= want, f"{path.name}: {want} fig.show() cells but {len(shown)} displays"

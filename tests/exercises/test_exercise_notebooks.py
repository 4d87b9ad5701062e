"""The exercise notebooks run headless (nbmake's runner): with the reference solutions injected
and strict checks (so a regression fails), and as a learner first opens them (stubs: every check
says "not implemented yet" and nothing crashes)."""

from pathlib import Path

import pytest
from nbmake.nb_run import NotebookRun

NOTEBOOKS = sorted((Path(__file__).parents[2] / "notebooks" / "exercises").glob("*.ipynb"))


def _run(path: Path):
    result = NotebookRun(path, default_timeout=300).execute()
    if result.error is not None:
        pytest.fail(f"{path.name} failed:\n{result.error.summary}\n{result.error.trace[-3000:]}")
    return result.nb


def _text(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("name") == "stdout")


def test_every_exercise_has_a_notebook():
    from labkit.exercises.progress import EXERCISES

    names = {p.stem for p in NOTEBOOKS}
    assert {nb for nb, _ in EXERCISES.values()} <= names and "drills" in names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_with_reference_solutions(path, monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_INJECT_SOLUTIONS", "1")  # implies strict checks in the kernel
    monkeypatch.setenv("LABKIT_PROGRESS", str(tmp_path / "progress.json"))
    _run(path)
    if path.stem != "drills":
        import json

        passed = json.loads((tmp_path / "progress.json").read_text())
        assert passed and all(e["passed"] for e in passed.values())


EXERCISE_NOTEBOOKS = [p for p in NOTEBOOKS if p.stem != "drills"]


@pytest.mark.slow
@pytest.mark.parametrize("path", EXERCISE_NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_as_a_learner_first_sees_it(path, monkeypatch, tmp_path):
    """Stubs untouched: every check says "not implemented yet" (never a wrong answer), every cell
    gated on a check says why it was skipped, and nothing crashes."""
    from labkit.exercises.progress import EXERCISES

    monkeypatch.setenv("LABKIT_PROGRESS", str(tmp_path / "progress.json"))
    nb = _run(path)
    code = [c for c in nb.cells if c.cell_type == "code"]
    out = "\n".join(_text(c) for c in code)
    assert "✗" not in out and "✓" not in out, out
    mine = [k for k, (nb_name, _) in EXERCISES.items() if nb_name == path.stem]
    for key in mine:
        assert f"· {key}: not implemented yet" in out, (key, out)
    for c in code:
        if "if ready(" in c.source:
            assert "· skipped: " in _text(c), (c.source, _text(c))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebooks_committed_without_outputs(path):
    import nbformat

    nb = nbformat.read(str(path), 4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            assert not cell.outputs and cell.execution_count is None, path.name
    # the learner's cells are stubs: solutions are never in the notebooks themselves
    if path.stem != "drills":
        assert any("your code here" in c.source for c in nb.cells if c.cell_type == "code")


# Exercise notebooks written after the main notebooks' first-cell rule (tests/notebooks/
# test_lab_settings.py) follow it too: they end with the progress widget.
WIDGET_NOTE = [p for p in NOTEBOOKS if p.stem[:2] in ("12", "13", "15")]


@pytest.mark.parametrize("path", WIDGET_NOTE, ids=lambda p: p.stem)
def test_first_cell_says_to_rerun_and_every_cell_has_an_id(path):
    import json

    raw = json.loads(path.read_text())
    assert all(c.get("id") for c in raw["cells"]), f"{path.name}: a cell has no id"
    first = raw["cells"][0]
    text = "".join(first["source"])
    assert first["cell_type"] == "markdown" and "Error displaying widget" in text
    assert "Run All" in text

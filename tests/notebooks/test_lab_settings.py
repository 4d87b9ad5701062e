"""The lab's JupyterLab settings (binder/overrides.json, installed by binder/postBuild and the
README's local setup) turn on saving widget state, and every main notebook's first cell says what
to do when a reopened notebook shows "Error displaying widget"; every cell has an id."""

import json
import re
import shutil
import sys
from pathlib import Path

import nbformat
import pytest

ROOT = Path(__file__).resolve().parents[2]
OVERRIDES = ROOT / "binder" / "overrides.json"
NOTEBOOKS = sorted((ROOT / "notebooks").glob("0*.ipynb"))


def test_overrides_turn_on_widget_state_saving_in_jupyterlab(tmp_path):
    su = pytest.importorskip("jupyterlab_server.settings_utils")
    app = tmp_path / "settings"
    app.mkdir()
    shutil.copy(OVERRIDES, app / "overrides.json")
    labext = [str(Path(sys.prefix) / "share" / "jupyter" / "labextensions")]
    name = "@jupyter-widgets/jupyterlab-manager:plugin"
    if not (Path(labext[0]) / "@jupyter-widgets" / "jupyterlab-manager").is_dir():
        pytest.skip("jupyterlab_widgets' lab extension is not installed in this environment")
    res, _ = su.get_settings(str(app), str(tmp_path / "schemas"), str(tmp_path / "user"),
                             schema_name=name, labextensions_path=labext)
    assert res["schema"]["properties"]["saveState"]["default"] is True


def test_binder_and_readme_install_the_overrides():
    post = (ROOT / "binder" / "postBuild").read_text()
    assert "cp binder/overrides.json" in post and "share/jupyter/lab/settings" in post
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"cp binder/overrides\.json \.venv/share/jupyter/lab/settings", readme)
    assert json.loads(OVERRIDES.read_text())


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_first_cell_says_to_rerun_and_every_cell_has_an_id(path):
    raw = json.loads(path.read_text())
    assert all(c.get("id") for c in raw["cells"]), f"{path.name}: a cell has no id"
    nb = nbformat.read(path, as_version=4)
    first = nb.cells[0]
    assert first.cell_type == "markdown" and "Error displaying widget" in first.source
    assert "Run All" in first.source

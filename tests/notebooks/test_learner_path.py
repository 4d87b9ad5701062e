"""The learner's path, in JupyterLab itself: Run > Run All Cells on notebooks 00-05 in headless
chromium (the solutions-injected environment, as CI executes notebooks), then check what a
learner would see: no cell error, no "Error displaying widget", no JavaScript console error, and
every page table opened on a step with KV blocks in use, every plotly figure on screen drew its
data (traces and SVG marks, not empty axes; widget tabs are clicked and checked too). A
screenshot of each notebook (and of each page table) goes to test-artifacts/. CI runs all of
00-05 (README, "Tests, CI and GPU checks", has the measurements behind that);
``LABKIT_LEARNER_PATH=quick`` runs only 00 and 01.

The notebooks run from a temporary copy (JupyterLab autosaves outputs into the files it opens),
with JupyterLab's windowing off so every cell is in the page. Everything listens on loopback.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path

import pytest
from browser_support import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, ROOT, free_port, serving

# 00-05 by default (the kernels need ~110 CPU-seconds in all); LABKIT_LEARNER_PATH=quick: 00, 01.
NOTEBOOKS = [p.name for p in sorted((ROOT / "notebooks").glob(
    "0[01]_*.ipynb" if os.environ.get("LABKIT_LEARNER_PATH") == "quick" else "0[0-5]_*.ipynb"))]
SETTINGS = {  # user settings for the temporary lab (file name -> JSON)
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyter-widgets/jupyterlab-manager/plugin.jupyterlab-settings": {"saveState": False},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False},
}
# Console noise that is not a learner-visible failure: the browser asking for a favicon or a
# translation bundle the server does not ship.
# A notebook fails when no cell finishes for STALL_S (a hang: a lost kernel connection leaves
# cells at [*] for ever), not after a fixed total, which a loaded machine stretches 4x (the
# slowest cell takes 38 s wall at load 18 on 2 cores, ~10 s idle). MAX_S bounds a notebook anyway.
STALL_S, MAX_S = 180, 900
BENIGN = re.compile(r"favicon|Failed to load resource: the server responded with a status of 404")

pytestmark = [
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.exists(CHROMIUM),
                       reason=f"{CHROMIUM} missing: run tests/notebooks/install_browser.sh"),
]


@pytest.fixture
def lab_url(tmp_path):
    pytest.importorskip("jupyterlab")
    work = tmp_path / "notebooks"
    work.mkdir()
    for name in NOTEBOOKS:
        shutil.copy(ROOT / "notebooks" / name, work / name)
    settings = tmp_path / "settings"
    for rel, value in SETTINGS.items():
        (settings / rel).parent.mkdir(parents=True, exist_ok=True)
        (settings / rel).write_text(json.dumps(value))
    port = free_port()
    env = dict(os.environ, LABKIT_INJECT_SOLUTIONS="1", OMP_NUM_THREADS="1",
               JUPYTERLAB_SETTINGS_DIR=str(settings),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp_path / "workspaces"))
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    try:
        with serving([sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}",
                      "--ServerApp.ip=127.0.0.1", "--IdentityProvider.token=",
                      "--ServerApp.password=", "--ServerApp.disable_check_xsrf=True",
                      f"--ServerApp.root_dir={work}", "--LabApp.news_url=", "--allow-root"],
                     port, tmp_path / "lab.log", cwd=work, env=env, startup_s=90) as url:
            yield url
    finally:
        ARTIFACTS.mkdir(exist_ok=True)
        shutil.copy(tmp_path / "lab.log", ARTIFACTS / "learner_path_lab.log")


PROMPTS = """() => Array.from(document.querySelectorAll(
    '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell .jp-InputArea-prompt'))
    .map(e => e.textContent.trim())"""
OUTPUT_TEXT = """() => Array.from(document.querySelectorAll(
    '.jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output'))
    .map(e => e.innerText).join('\\n')"""
PAGE_TABLES = """() => Array.from(document.querySelectorAll(
    '.jp-NotebookPanel:not(.lm-mod-hidden) .labkit-pagetable-summary'))
    .map(e => e.innerText)"""
VISIBLE_PAGE_TABLES = """() => Array.from(document.querySelectorAll(
    '.jp-NotebookPanel:not(.lm-mod-hidden) .labkit-pagetable'))
    .filter(e => e.getClientRects().length > 0).length"""
WIDGET_TABS = ".jp-NotebookPanel:not(.lm-mod-hidden) .widget-tab-bar .lm-TabBar-tab"
# Every plotly figure in the notebook as drawn (a labkit widget's figure is the one inside an
# element of class labkit-*-figure): its traces and the marks plotly put in the SVG. A figure
# whose data never arrived draws empty axes: no traces, no marks. Only figures on screen count
# (one in a widget tab not selected is checked when the tab is clicked).
FIGURES = """() => Array.from(document.querySelectorAll(
    '.jp-NotebookPanel:not(.lm-mod-hidden) .js-plotly-plot'))
    .filter(gd => gd.getClientRects().length > 0).map(gd => {
    const box = gd.closest('[class*="labkit-"][class$="-figure"]');
    const marks = ['g.trace path.point', 'g.trace.bars path', 'g.trace path.js-line',
                   'g.trace path.js-fill', '.heatmaplayer .hm', '.iciclelayer path.surface',
                   '.table .cell-text'];
    return {cls: box ? Array.from(box.classList).find(c => c.endsWith('-figure')) : 'fig.show()',
            traces: gd.data ? gd.data.length : 0,
            marks: gd.querySelectorAll(marks.join(', ')).length,
            points: gd.querySelectorAll('g.trace path.point').length,
            table: gd.querySelectorAll('.subplot.x2y2 g.trace path.point').length};
})"""


def _click_run_all(page) -> None:
    page.get_by_role("menuitem", name="Run", exact=True).click()
    page.get_by_role("menuitem", name="Run All Cells", exact=True).click()


def _run_all(page, name: str, stall_s: float = STALL_S, max_s: float = MAX_S) -> None:
    """Open `name`, wait for its kernel, Run All, wait until every code cell has run; fail when
    no cell finishes for `stall_s` or the notebook takes over `max_s`.

    On a loaded machine the kernel can report idle before its session settles, and a restart
    then drops the queued cells (every prompt back to "[ ]"): Run All is clicked again then."""
    page.goto(page.url.split("/lab")[0] + f"/lab/tree/{name}?reset",
              wait_until="domcontentloaded")
    page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-CodeCell", timeout=60_000)
    page.wait_for_selector(".jp-NotebookPanel:not(.lm-mod-hidden) "
                           ".jp-Notebook-ExecutionIndicator[data-status='idle']",
                           timeout=120_000)
    page.wait_for_timeout(2000)   # let the kernel connection settle
    _click_run_all(page)
    start = clicked = progress_at = time.monotonic()
    retries, done = 0, -1
    while time.monotonic() - progress_at < stall_s and time.monotonic() - start < max_s:
        prompts = page.evaluate(PROMPTS)
        if prompts and all(re.fullmatch(r"\[\d+\]:", p) for p in prompts):
            return
        finished = sum(bool(re.fullmatch(r"\[\d+\]:", p)) for p in prompts)
        if finished != done:
            done, progress_at = finished, time.monotonic()
        running = any("*" in p for p in prompts)
        if not running and any(p != "[ ]:" for p in prompts) and "Traceback" in page.evaluate(
                OUTPUT_TEXT):
            return   # a cell failed and Run All stopped there: the caller reports it
        idle = all(p == "[ ]:" for p in prompts)
        if idle and time.monotonic() - clicked > 15 and retries < 3:
            _click_run_all(page)
            clicked, retries = time.monotonic(), retries + 1
        page.wait_for_timeout(1000)
    page.screenshot(path=str(ARTIFACTS / f"lab_{Path(name).stem}_timeout.png"))
    raise AssertionError(f"{name}: Run All stalled ({done} cells done, none more in "
                         f"{stall_s:.0f} s; {time.monotonic() - start:.0f} s in all; "
                         f"{retries} retries): {prompts}")


def _assert_figures_drawn(page, name: str) -> None:
    """Every labkit figure in the notebook drew its data (plotly draws asynchronously, so wait
    a while first); a page table drew its block grid and its block tables."""
    def drawn(figs: list[dict]) -> bool:
        return all(f["traces"] and f["marks"] for f in figs)

    deadline = time.monotonic() + 30
    while not drawn(figs := page.evaluate(FIGURES)) and time.monotonic() < deadline:
        page.wait_for_timeout(500)
    print(f"{name}: {len(figs)} figures: {figs}")
    empty = [f for f in figs if not (f["traces"] and f["marks"])]
    assert not empty, f"{name}: figures drew empty axes: {empty} (of {len(figs)})"
    tables = [f for f in figs if f["cls"] == "labkit-pagetable-figure"]
    assert len(tables) == page.evaluate(VISIBLE_PAGE_TABLES), f"{name}: a page table has no figure"
    for f in tables:
        assert f["points"] > f["table"] > 0, f"{name}: a page table drew no blocks: {f}"


def _visit_widget_tabs(page, name: str) -> None:
    """Click every tab of every Tab widget (as a learner would) and check what it shows."""
    tabs = page.locator(WIDGET_TABS)
    for i in range(tabs.count()):
        tabs.nth(i).click()
        _assert_figures_drawn(page, f"{name}, widget tab {tabs.nth(i).inner_text()!r}")


def test_run_all_in_jupyterlab(lab_url):
    from playwright.sync_api import TimeoutError as PlaywrightTimeout
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(exist_ok=True)
    console: list[str] = []
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS,
                                     headless=True)
        try:
            page = browser.new_context(viewport={"width": 1280, "height": 1600}).new_page()
            page.on("console", lambda m: console.append(f"{m.type}: {m.text}")
                    if m.type == "error" and not BENIGN.search(m.text) else None)
            page.on("pageerror", lambda e: console.append(f"pageerror: {e}"))
            page.goto(lab_url + "lab", wait_until="domcontentloaded")
            for name in NOTEBOOKS:
                start = time.monotonic()
                _run_all(page, name)
                print(f"{name}: Run All took {time.monotonic() - start:.0f} s")
                page.wait_for_timeout(1500)   # let the last widgets draw
                text = page.evaluate(OUTPUT_TEXT)
                page.screenshot(path=str(ARTIFACTS / f"lab_{Path(name).stem}.png"))
                tables = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .labkit-pagetable")
                for i in range(tables.count()):
                    if not tables.nth(i).is_visible():
                        continue   # in a widget tab not selected
                    tables.nth(i).scroll_into_view_if_needed()
                    with contextlib.suppress(PlaywrightTimeout):   # for the screenshot only
                        tables.nth(i).locator(".scatterlayer path.point").first.wait_for(
                            state="attached", timeout=15_000)
                    tables.nth(i).screenshot(
                        path=str(ARTIFACTS / f"lab_{Path(name).stem}_page_table{i}.png"))
                assert "Traceback" not in text, f"{name}: a cell failed:\n{text[-3000:]}"
                assert "Error displaying widget" not in text, f"{name}: a widget failed"
                _assert_figures_drawn(page, name)
                _visit_widget_tabs(page, name)
                for summary in page.evaluate(PAGE_TABLES):
                    used = re.search(r"KV blocks used (\d+)", summary)
                    assert used and int(used.group(1)) > 0, f"{name}: page table opened " \
                        f"on an empty pool: {summary}"
                page.get_by_role("menuitem", name="Kernel", exact=True).click()
                page.get_by_role("menuitem", name="Shut Down Kernel", exact=True).click()
                page.wait_for_timeout(500)
        finally:
            browser.close()
    assert not console, "JavaScript console errors:\n" + "\n".join(console[:20])

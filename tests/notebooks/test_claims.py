"""What notebook 06 and the exercise notebooks say about named systems (vLLM, llama.cpp,
FlashAttention, the H200, ...) is either cited in the same markdown cell (a URL, or
``owner/repo: path`` as in labkit/exercises/drills_sources.py), labelled *Background*, or checked
by an ``assert`` in the code cell right before or after it. The drills notebook is covered by
tests/exercises/test_drills.py (every drill naming a system has a Claim with its source)."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from labkit.exercises.drills_sources import SYSTEMS

ROOT = Path(__file__).resolve().parents[2]
# every exercise notebook (01-13) follows this rule (issue 19); a new one joins by raising the bound
NOTEBOOKS = [ROOT / "notebooks" / "06_triton_kernels.ipynb"] + [
    p for p in sorted((ROOT / "notebooks" / "exercises").glob("[01][0-9]_*.ipynb"))
    if int(p.stem[:2]) <= 13]
# hardware and papers the notebooks state facts about, beside the drills' system names
NAMED = {**SYSTEMS, "FlashAttention": r"\bFlashAttention\b", "ggml": r"\bggml\b",
         "H100/H200/Hopper": r"\bH[12]00\b|\bHopper\b", "tensor cores": r"\btensor cores\b"}
CITATION = re.compile(r"https?://\S+|\b[\w.-]+/[\w.-]+: \S+|\*Background")


def _checked(cells: list, i: int) -> bool:
    near = [cells[j] for j in (i - 1, i + 1) if 0 <= j < len(cells)]
    return any(c.cell_type == "code" and re.search(r"^\s*assert\b", c.source, re.M)
               for c in near)


def _uncited(path: Path) -> list[str]:
    cells = nbformat.read(path, as_version=4).cells
    bad = []
    for i, cell in enumerate(cells):
        if cell.cell_type != "markdown":
            continue
        names = [n for n, rx in NAMED.items() if re.search(rx, cell.source)]
        if names and not CITATION.search(cell.source) and not _checked(cells, i):
            bad.append(f"{cell.id} names {names}")
    return bad


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_claims_about_named_systems_are_cited_or_checked(path):
    bad = _uncited(path)
    assert not bad, f"{path.name}: cite (URL or owner/repo: path), label *Background*, or " \
        f"assert next to: {bad}"


def test_the_rule_catches_an_uncited_claim(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("vLLM preallocates KV contiguously.", id="m1"),
                nbformat.v4.new_code_cell("print(1)", id="c1"),
                nbformat.v4.new_markdown_cell("FlashAttention, see https://arxiv.org/abs/2205"
                                              ".14135", id="m2"),
                nbformat.v4.new_markdown_cell("An H200 streams at 4.8 TB/s.", id="m3"),
                nbformat.v4.new_code_cell("assert bandwidth > 4e12", id="c3")]
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, path)
    assert _uncited(path) == ["m1 names ['vLLM']"]

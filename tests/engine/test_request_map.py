"""labkit/README.md's "How a request flows" stays true: at most 8 files, every function it names
exists where it says, and a real generate() call runs through each of those files."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import labkit
from labkit.engine.llm import LLM
from labkit.engine.sampling_params import SamplingParams

ROOT = Path(labkit.__file__).parent
ROW = re.compile(r"^\| *\d+ *\| *`([^`]+)` *\| *(.+?) *\|")


def path_rows() -> list[tuple[str, list[str]]]:
    """(file, [function names]) per row of the request-path table, in order."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## How a request flows", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        m = ROW.match(line)
        if m:
            rows.append((m.group(1), re.findall(r"`([^`]+)`", m.group(2))))
    return rows


def defined_names(path: Path) -> tuple[set[str], set[str]]:
    tree = ast.parse(path.read_text())
    funcs = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef,
                                                               ast.AsyncFunctionDef))}
    classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
    return funcs, classes


def test_the_path_has_at_most_eight_files_and_its_functions_exist():
    rows = path_rows()
    assert len(rows) >= 10, "the table was not found"
    files = {f for f, _ in rows}
    assert len(files) <= 8, sorted(files)
    for file, names in rows:
        funcs, classes = defined_names(ROOT / file)
        for name in names:
            *owner, func = name.lstrip(".").split(".")
            assert func in funcs, f"{file}: no function {func!r} (row names {name!r})"
            assert all(o in classes for o in owner), f"{file}: no class {owner} ({name!r})"


def test_generate_runs_through_every_file_of_the_path(tiny_model):
    llm = LLM.from_model(tiny_model, block_size=4, num_blocks=16)
    seen: set[str] = set()

    def profile(frame, event, arg):
        if event == "call":
            seen.add(frame.f_code.co_filename)

    sys.setprofile(profile)
    try:
        llm.generate(prompt_token_ids=[[3, 4, 5]],
                     sampling_params=SamplingParams(temperature=0, max_tokens=2))
    finally:
        sys.setprofile(None)
    for file in {f for f, _ in path_rows()}:
        assert str(ROOT / file) in seen, f"generate() never ran code in {file}"

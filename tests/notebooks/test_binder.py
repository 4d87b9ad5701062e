"""binder/ must launch labkit on mybinder.org: pinned CPU torch, every runtime dependency
pinned, labkit installed by postBuild, the Triton interpreter switched on by start."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[2]
BINDER = ROOT / "binder"


def _requirements() -> tuple[list[str], dict[str, str]]:
    options, pins = [], {}
    for line in (BINDER / "requirements.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("-"):
            options.append(line)
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
        assert m, f"binder/requirements.txt: {line!r} is not pinned with =="
        pins[m.group(1).lower()] = m.group(2)
    return options, pins


def _name(req: str) -> str:
    return re.split(r"[<>=!~;\[ ]", req, maxsplit=1)[0].lower()


def test_requirements_pin_a_cpu_torch_and_every_dependency():
    options, pins = _requirements()
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in options
    assert pins["torch"].endswith("+cpu"), "Binder must take the CPU torch wheel"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = [*project["dependencies"], *project["optional-dependencies"]["lab"]]
    missing = sorted({_name(r) for r in needed} - set(pins))
    assert not missing, f"binder/requirements.txt does not pin {missing}"


def test_postbuild_installs_labkit_and_start_sets_interpreter(tmp_path):
    post, start = BINDER / "postBuild", BINDER / "start"
    assert os.access(post, os.X_OK) and os.access(start, os.X_OK)
    assert re.search(r"pip install .*-e \.", post.read_text())
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([str(start), sys.executable, "-c",
                          "import os; print(os.environ['TRITON_INTERPRET'])"],
                         env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "1"


def test_runtime_pins_the_python_the_pins_need():
    # numpy 2.3+ and scipy 1.17 need Python >= 3.11; repo2docker's default is older.
    assert (BINDER / "runtime.txt").read_text().strip() == "python-3.11"

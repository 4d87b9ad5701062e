"""Exercise tests: progress goes to a temporary file, checks never run in strict mode here, and
Triton's interpreter is chosen before any test module defines a kernel (wrong_kernels.py)."""

import pytest

from labkit.exercises.triton_kernels import ensure_interpreter

ensure_interpreter()


@pytest.fixture(autouse=True)
def _isolated_progress(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_PROGRESS", str(tmp_path / "progress.json"))
    monkeypatch.delenv("LABKIT_STRICT_CHECKS", raising=False)
    monkeypatch.delenv("LABKIT_INJECT_SOLUTIONS", raising=False)

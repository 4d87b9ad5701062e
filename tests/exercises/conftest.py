"""Exercise tests: progress goes to a temporary file, checks never run in strict mode here."""

import pytest


@pytest.fixture(autouse=True)
def _isolated_progress(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_PROGRESS", str(tmp_path / "progress.json"))
    monkeypatch.delenv("LABKIT_STRICT_CHECKS", raising=False)
    monkeypatch.delenv("LABKIT_INJECT_SOLUTIONS", raising=False)

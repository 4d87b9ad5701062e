"""Regression tests for findings of the JupyterLab browser pass (issue 27) outside the notebooks'
own asserts: the exercise progress widget and the speculative-decoding controls."""

from __future__ import annotations

import pytest

from labkit.exercises import prefix_cache, progress


@pytest.fixture(autouse=True)
def _isolated_progress(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_PROGRESS", str(tmp_path / "progress.json"))
    monkeypatch.delenv("LABKIT_STRICT_CHECKS", raising=False)
    monkeypatch.delenv("LABKIT_INJECT_SOLUTIONS", raising=False)


def _stub(*args, **kwargs):
    raise NotImplementedError  # your code here


def _states(widget) -> str:
    return widget.children[1].value


def test_untouched_stub_is_not_a_failed_attempt():
    """A fresh Run All checks every stub once: each must stay "not tried", attempts 0."""
    for _ in range(2):  # Run All twice: still nothing attempted
        assert not prefix_cache.check_hashes(_stub)
        assert not prefix_cache.check_lookup(_stub)
    data = progress.load_progress()
    assert data.get("block_hashes", {}).get("attempts", 0) == 0
    assert data.get("longest_cached_prefix", {}).get("attempts", 0) == 0
    table = _states(progress.progress_widget())
    assert "✗ not yet" not in table and table.count("· not tried") == len(progress.EXERCISES)
    summary = progress.summary()
    assert "✗" not in summary and "block_hashes" in summary


def test_a_real_wrong_answer_still_counts():
    """The control: a function that returns something wrong is an attempt, and fails."""
    prefix_cache.check_hashes(_stub)
    assert not prefix_cache.check_hashes(lambda tokens, bs, salt=None: [])
    e = progress.load_progress()["block_hashes"]
    assert e["attempts"] == 1 and not e["passed"]
    table = _states(progress.progress_widget())
    assert "✗ not yet" in table


def test_record_unattempted_keeps_earlier_attempts():
    progress.record("spec_speedup", False)
    progress.record("spec_speedup", False, attempted=False)
    assert progress.load_progress()["spec_speedup"]["attempts"] == 1
    with pytest.raises(ValueError):
        progress.record("spec_speedup", True, attempted=False)


def test_spec_controls_label_has_room():
    """05's γ slider sat squeezed under its label: the label must size itself ('initial'),
    and the slider keep a width of its own."""
    from labkit.viz.controls import SpecControls

    c = SpecControls(["def f():"], run=False)
    assert c.gamma.style.description_width == "initial"
    assert c.gamma.layout.width and c.gamma.layout.width.endswith("px")
    assert int(c.gamma.layout.width[:-2]) >= 300
    assert c.method.style.description_width == "initial"

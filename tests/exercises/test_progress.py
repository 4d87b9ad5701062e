"""Progress file: records attempts, keeps passes, survives corruption, path from the env var."""

import json

import pytest
import wrong_answers as W

from labkit.exercises import kv_size, progress
from labkit.exercises import solutions as S


def test_progress_path_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_PROGRESS", str(tmp_path / "p.json"))
    assert progress.progress_path() == tmp_path / "p.json"


def test_check_records_attempts_and_keeps_pass():
    kv_size.check(W.kv_bytes_forgets_v)
    data = progress.load_progress()
    assert data["kv_cache_bytes"]["attempts"] == 1 and not data["kv_cache_bytes"]["passed"]
    kv_size.check(S.kv_cache_bytes)
    kv_size.check(W.kv_bytes_forgets_v)  # a later failure does not un-pass it
    e = progress.load_progress()["kv_cache_bytes"]
    assert e["attempts"] == 3 and e["passed"] and not e["last_passed"]
    on_disk = json.loads(progress.progress_path().read_text())
    assert on_disk["kv_cache_bytes"]["passed"] is True
    assert f"1/{len(progress.EXERCISES)} exercises passed" in progress.summary()


def test_corrupt_file_is_ignored_then_rewritten():
    progress.progress_path().write_text("{not json")
    assert progress.load_progress() == {}
    progress.record("spec_speedup", True)
    assert progress.load_progress()["spec_speedup"]["passed"]


def test_unknown_exercise_rejected():
    with pytest.raises(ValueError, match="valid: kv_cache_bytes"):
        progress.record("nope", True)


def test_widget_shows_counts():
    progress.record("block_hashes", True)
    progress.record("schedule_step", False)
    box = progress.progress_widget()
    bar, table = box.children[0].children[0], box.children[1]
    assert bar.value == 1 and bar.max == len(progress.EXERCISES)
    assert box.children[0].children[1].value == f"1 of {len(progress.EXERCISES)} exercises passed"
    assert "✓ passed" in table.value and "✗ not yet" in table.value


def test_reset():
    progress.record("block_hashes", True)
    progress.reset_progress()
    assert progress.load_progress() == {}

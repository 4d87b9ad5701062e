"""``labkit bench ops cancel --quick`` against real ``labkit serve`` processes: every cancel path
frees every KV block (the server's own gauge reads 0), the cancelled streams end with
``finish_reason: "abort"``, and ``--stream-interval`` changes the events, not the text. Counts
are checked against hand-computed ones; no time is asserted (the machine sets those)."""

from __future__ import annotations

import json
import math

import pytest

from labkit.bench import ops, ops_cancel


@pytest.mark.slow
def test_quick_run_writes_paths_intervals_and_chart(tmp_path):
    out = tmp_path / "ops_cancel.json"
    assert ops.main(["cancel", "--quick", "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    cfg = r["config"]
    assert r["benchmark"] == "ops cancel" and r["quick"] is True
    assert set(r["cancel_paths"]) == set(ops_cancel.PATHS)
    for path, s in r["cancel_paths"].items():
        assert s["trials"] == s["freed"] == cfg["trials"], path  # every trial freed its blocks
        assert s["freed_ms_median"] > 0 and s["freed_ms_max"] >= s["freed_ms_median"]
    assert r["cancel_paths"]["cancel-route"]["ended_cleanly"] is True
    assert r["cancel_paths"]["ws-cancel"]["ended_cleanly"] is True
    assert all(t["kv_usage_before"] > 0 for t in r["cancel_trials"])  # blocks were held
    assert r["same_text"] is True
    m = cfg["max_tokens"]
    rows = {row["stream_interval"]: row for row in r["stream_intervals"]}
    assert sorted(rows) == cfg["intervals"]
    for n, row in rows.items():  # the first token alone, then n per event, the rest last
        assert row["events_per_token"] == pytest.approx((1 + math.ceil((m - 1) / n)) / m)
        assert row["output_tokens"] == m * cfg["concurrency"]
    assert rows[1]["bytes_per_token"] > rows[4]["bytes_per_token"] > rows[16]["bytes_per_token"]
    assert len(r["environment"]["load_average_at_start"]) == 3
    assert (tmp_path / "ops_cancel.html").exists()


def test_listed():
    assert ops.EXPERIMENTS["cancel"] == ops_cancel.__name__
    assert any(line.startswith("cancel: how fast each cancel path frees KV")
               for line in ops.describe())

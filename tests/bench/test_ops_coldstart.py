"""``labkit bench ops cold-start``: every way of loading from S3 generates what the local folder
does; the worker runs in this process here (the real command starts a fresh one per way)."""

from __future__ import annotations

import json
import time

import pytest

pytest.importorskip("moto", reason="the objstore extra (moto) is not installed")

import labkit.bench.ops_coldstart as cs  # noqa: E402
from labkit.bench.ops import describe  # noqa: E402

TINY = {"hidden": 64, "intermediate": 128, "layers": 2, "heads": 4, "kv_heads": 2,
        "per_conn_mbps": 800.0, "total_mbps": 3200.0, "part_mib": 1, "tokens": 6}


@pytest.mark.slow
def test_quick_run_reports_each_mode_and_outputs_match(monkeypatch, tmp_path):
    seen = []

    def in_process(mode, uri, endpoint, cache, cfg):
        seen.append(mode)
        return cs.worker(mode, uri, endpoint, str(cache), cfg, time.time())

    monkeypatch.setattr(cs, "_spawn", in_process)
    payload = cs.run(quick=True, sizes=TINY)
    assert seen == list(cs.MODES)
    assert payload["outputs_match"] is True
    assert [r["mode"] for r in payload["rows"]] == list(cs.MODES)
    for r in payload["rows"]:
        assert 0 < r["import_s"] <= r["weights_s"] <= r["loaded_s"] <= r["first_token_s"]
    assert payload["params"] > 0 and payload["ranged_over_sequential"] > 0
    assert "load_average_at_start" in payload["environment"]
    json.dumps(payload)


def test_listed_among_the_ops_experiments():
    assert any(line.startswith("cold-start:") for line in describe())

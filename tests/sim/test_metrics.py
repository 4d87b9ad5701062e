"""compute_metrics and kv_usage against hand-computed values."""

import math

import pytest

from labkit.engine.metrics import compute_metrics, kv_summary, kv_usage, summarize


def _t(rid, arrival, sched, times, finish=None, **kw):
    return {"request_id": rid, "arrival_time": arrival, "first_scheduled_time": sched,
            "first_token_time": times[0] if times else None, "token_times": times,
            "finish_time": times[-1] if finish is None and times else finish, **kw}


TIMINGS = [
    # a: arrives 0, scheduled 0.5, tokens at 1, 2, 4 -> TTFT 1, TPOT 1.5, ITL 1, 2, E2E 4
    _t("a", 0.0, 0.5, [1.0, 2.0, 4.0], prompt_len=10),
    # b: arrives 1, scheduled 1, tokens at 3, 3.5 -> TTFT 2, TPOT 0.5, ITL 0.5, E2E 2.5
    _t("b", 1.0, 1.0, [3.0, 3.5], prompt_len=6),
    # c: arrives 2, scheduled 3, one token at 6 -> TTFT 4, no TPOT, E2E 4
    _t("c", 2.0, 3.0, [6.0], prompt_len=4),
]


def test_summarize_percentiles_linear():
    s = summarize([1, 2, 3, 4])
    assert s["mean"] == 2.5 and s["p50"] == 2.5
    assert s["p90"] == pytest.approx(3.7)  # 3 + 0.7 * (4 - 3)
    assert s["p99"] == pytest.approx(3.97)
    assert summarize([])["p50"] is None


def test_hand_computed_metrics():
    m = compute_metrics(TIMINGS)
    assert m["ttft"]["mean"] == pytest.approx((1 + 2 + 4) / 3)
    assert m["ttft"]["p50"] == 2.0
    assert m["tpot"]["mean"] == pytest.approx((1.5 + 0.5) / 2)
    assert m["itl"]["mean"] == pytest.approx((1 + 2 + 0.5) / 3)
    assert m["itl"]["p50"] == 1.0
    assert m["e2e"]["mean"] == pytest.approx((4 + 2.5 + 4) / 3)
    assert m["queue"]["mean"] == pytest.approx((0.5 + 0 + 1) / 3)
    # 6 output tokens from t=0 to t=6.
    assert m["duration_s"] == 6.0
    assert m["output_tokens"] == 6 and m["prompt_tokens"] == 20
    assert m["tokens_per_s"] == pytest.approx(1.0)
    assert m["requests_per_s"] == pytest.approx(0.5)
    assert m["num_requests"] == 3 and m["num_finished"] == 3


def test_n_samples_count_one_request_and_abort_excluded_from_e2e():
    timings = [
        _t("r", 0.0, 0.0, [1.0, 2.0], prompt_len=5) | {"seq_id": "r:0"},
        _t("r", 0.0, 0.0, [1.0, 3.0], prompt_len=5) | {"seq_id": "r:1"},
        _t("x", 0.0, 0.0, [1.0], finish=1.5, finish_reason="abort"),
    ]
    m = compute_metrics(timings)
    assert m["num_requests"] == 2 and m["num_finished"] == 1
    assert m["prompt_tokens"] == 5  # one prompt, shared by both samples
    assert m["e2e"]["mean"] == pytest.approx(2.5)
    assert m["output_tokens"] == 5


def test_unfinished_and_empty():
    m = compute_metrics([_t("a", 0.0, None, [], finish=None)])
    assert m["ttft"]["mean"] is None and m["tokens_per_s"] is None
    assert compute_metrics([])["num_requests"] == 0


def test_bad_timings():
    with pytest.raises(ValueError, match="arrival_time"):
        compute_metrics([{"token_times": [1.0]}])
    with pytest.raises(ValueError, match="non-decreasing"):
        compute_metrics([_t("a", 0.0, 0.0, [2.0, 1.0])])


def _trace():
    def step(i, t, dur, used, slots, total=10):
        return {"step": i, "time": t, "duration": dur,
                "kv": {"used": used, "free": total - used, "cached": 0, "total": total,
                       "token_slots_used": slots}}
    return {"meta": {"block_size": 4},
            "steps": [step(0, 0.0, 1.0, 2, 8), step(1, 1.0, 3.0, 4, 12), step(2, 4.0, 1.0, 0, 0)]}


def test_kv_usage_rows():
    rows = kv_usage(_trace())
    assert [r["usage"] for r in rows] == [0.2, 0.4, 0.0]
    assert rows[0]["slot_utilization"] == 1.0
    assert rows[1]["slot_utilization"] == 0.75  # 12 tokens in 4 blocks of 4
    assert rows[2]["slot_utilization"] is None


def test_kv_summary_duration_weighted():
    s = kv_summary(_trace())
    assert s["mean_usage"] == pytest.approx((0.2 * 1 + 0.4 * 3 + 0.0 * 1) / 5)
    assert s["peak_usage"] == 0.4
    assert s["mean_slot_utilization"] == pytest.approx((1.0 * 1 + 0.75 * 3) / 4)
    assert not math.isnan(s["mean_usage"])
    with pytest.raises(ValueError, match="Trace"):
        kv_usage(42)

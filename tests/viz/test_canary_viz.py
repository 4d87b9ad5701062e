"""The canary figures from a hand-made run result: the rollback line at the first request sent
with weight 0, errors drawn as crosses, every check's verdict colour, the PromQL table cells."""

from labkit.viz.canary import VERDICT, plot_canary, promql_table, rollback_index


def _result():
    reqs = []
    for i in range(12):
        arm = "candidate" if i % 2 and i < 8 else "baseline"
        err = arm == "candidate" and i == 5
        reqs.append({"i": i, "arm": arm, "ttft": None if err else 0.1 + (arm == "candidate"),
                     "status": 503 if err else 200, "weight_at_start": 0.5 if i < 9 else 0.0})
    m = {"baseline": {"n": 20, "error_rate": 0.0, "ttft_p99": 0.1},
         "candidate": {"n": 20, "error_rate": 0.1, "ttft_p99": 1.1}}
    checks = [{"action": "wait", "reason": "", "metrics": {"baseline": None, "candidate": None}},
              {"action": "fail", "reason": "TTFT p99", "metrics": m},
              {"action": "rollback", "reason": "TTFT p99", "metrics": m}]
    return {"requests": reqs, "checks": checks, "rolled_back": True, "rolled_back_after": 4,
            "reason": "TTFT p99 1.1s vs baseline 0.1s", "degrade_after": 3, "delay_s": 1.0}


def test_plot_canary_marks_degradation_rollback_and_verdicts():
    r = _result()
    assert rollback_index(r) == 9
    fig = plot_canary(r, ratio=2.0)
    assert sorted(s["x0"] for s in fig.layout.shapes) == [3, 9]  # degrades, rolled back
    assert {a.text for a in fig.layout.annotations} >= {"candidate degrades", "rolled back"}
    names = [t.name for t in fig.data]
    assert "candidate error" in names and "baseline error" not in names
    err = next(t for t in fig.data if t.name == "candidate error")
    assert list(err.x) == [5]
    verdicts = fig.data[-1]
    assert list(verdicts.marker.color) == [VERDICT["fail"], VERDICT["rollback"]]  # "wait" omitted
    ceiling = next(t for t in fig.data if t.name == "2.0x baseline")
    assert list(ceiling.y) == [0.2, 0.2]
    assert fig.layout.title.text.startswith("rolled back after 4 candidate requests")


def test_promql_table_cells():
    rows = [{"arm": "candidate", "quantity": "requests", "promql": "sum(x)",
             "prometheus": 42.0, "router": 42.0},
            {"arm": "candidate", "quantity": "TTFT p99 (s)", "promql": "histogram_quantile(...)",
             "prometheus": None, "router": 0.123456789}]
    cells = promql_table(rows).data[0].cells.values
    assert list(cells[2]) == ["sum(x)", "histogram_quantile(...)"]
    assert list(cells[3]) == ["42", "-"] and list(cells[4]) == ["42", "0.123457"]

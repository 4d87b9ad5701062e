"""labkit.bench.common's harness: greedy params, timed calls, and compare()'s verdicts.

The reference for a speed-up is work whose cost ratio is known by construction: a pure-Python
loop of 2N iterations against one of N costs 2x the CPU time."""

import itertools
import time

import pytest

from labkit.bench.common import Timing, compare, greedy_params, timed, write_results


def _spin(n: int) -> int:
    x = 0
    for i in range(n):
        x += i
    return x


def _loops(n: int) -> dict:
    return {"fast": lambda: (lambda: _spin(n)), "slow": lambda: (lambda: _spin(2 * n))}


def test_greedy_params_are_greedy_exact_length_and_skip_text():
    p = greedy_params(7)
    assert (p.temperature, p.max_tokens, p.ignore_eos, p.detokenize) == (0.0, 7, True, False)
    assert greedy_params(3, detokenize=True).detokenize is True


def test_timed_separates_cpu_from_wall():
    out, t = timed(time.sleep, 0.2)
    assert out is None and t.wall_s >= 0.19 and t.cpu_s < 0.05 and t.load > 4
    _, busy = timed(_spin, 300_000)
    assert busy.cpu_s > 0 and busy.wall_s > 0


def test_compare_recovers_a_known_cost_ratio():
    c = compare(_loops(200_000), baseline="slow", max_load=float("inf"))
    assert c.rounds >= 3 and set(c.speedups) == {"fast"}
    # a real measurement: loose bounds (the exact arithmetic is tested with a fake clock below)
    assert 1.5 < c.speedup("fast") < 2.5
    assert c.results["fast"] == _spin(200_000)
    if c.trusted:
        assert c.describe("fast").startswith("fast / slow = ")


def test_compare_reports_the_median_round(monkeypatch):
    # a fake clock: each run reports a known CPU cost; one round is disturbed (a 5x outlier)
    from labkit.bench import common

    costs = {"slow": iter([2.0, 2.0, 10.0, 2.0, 2.0]), "fast": iter([1.0] * 5)}

    def fake_timed(work, **_):
        name = work()
        c = next(costs[name])
        return name, Timing(wall_s=c, cpu_s=c)

    monkeypatch.setattr(common, "timed", fake_timed)
    c = compare({"slow": lambda: (lambda: "slow"), "fast": lambda: (lambda: "fast")},
                min_rounds=5, max_rounds=5, warmup=False)
    assert c.rounds == 5 and c.speedups["fast"] == [2.0, 2.0, 10.0, 2.0, 2.0]
    assert c.speedup("fast") == 2.0 and c.trusted


def test_compare_flags_a_process_that_barely_ran():
    # sleeping stands in for a process that is runnable but not running: wall >> CPU
    c = compare({"a": lambda: (lambda: time.sleep(0.02)), "b": lambda: (lambda: time.sleep(0.02))},
                min_rounds=2, max_rounds=2)
    assert not c.trusted and "too busy" in c.problems[0]
    assert "no trustworthy number" in c.describe("b") and "rerun" in c.describe("b")


def test_compare_flags_rounds_that_disagree():
    costs = itertools.cycle([1, 4])   # b costs 1/2, then 2x a's work, in turn

    def b():
        n = next(costs)
        return lambda: _spin(100_000 * n // 2)

    rounds = {"a": lambda: (lambda: _spin(100_000)), "b": b}
    c = compare(rounds, min_rounds=4, max_rounds=4, max_load=float("inf"))
    assert c.rounds == 4
    assert not c.trusted and "disagree" in c.problems[0]


def test_compare_stops_at_its_time_cap():
    c = compare(_loops(50_000), min_rounds=2, max_rounds=50, max_seconds=0.0, max_spread=0.0)
    assert c.rounds == 2 and c.time_cap_hit


def test_compare_names_a_missing_baseline():
    with pytest.raises(ValueError, match="'nope'"):
        compare(_loops(10), baseline="nope")


def test_timing_load_is_wall_over_cpu():
    assert Timing(wall_s=3.0, cpu_s=1.0).load == 3.0


def test_write_results_writes_json_and_chart(tmp_path):
    seen = []
    write_results(tmp_path / "r.json", {"x": 1}, lambda p, path: seen.append((p["x"], path)))
    assert (tmp_path / "r.json").exists() and seen == [(1, tmp_path / "r.html")]
    write_results(None, {"x": 1}, lambda p, path: seen.append(path))
    assert len(seen) == 1

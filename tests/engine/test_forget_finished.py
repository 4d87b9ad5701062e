"""LLMEngine.forget_finished: a long-running engine drops finished requests (flat memory) and
still answers request_timings() for the recent ones, with unchanged metrics."""

from __future__ import annotations

import pytest

from labkit.engine.errors import InvalidPromptError
from labkit.engine.invariants import assert_no_leaks
from labkit.engine.llm_engine import LLMEngine
from labkit.engine.metrics import compute_metrics
from labkit.engine.sampling_params import SamplingParams

SP = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def _engine(model, **kw):
    return LLMEngine.from_model(model, None, block_size=4, num_blocks=64, **kw)


def _drain(eng):
    while eng.has_unfinished_requests():
        eng.step()


def test_forget_keeps_live_requests_and_timings_of_finished(tiny_model):
    eng = _engine(tiny_model)
    for i in range(4):
        eng.add_request(f"r{i}", [1 + i, 2, 3], SP)
    _drain(eng)
    eng.add_request("live", [9, 9, 9], SamplingParams(temperature=0, max_tokens=50,
                                                      ignore_eos=True))
    eng.step()
    eng.abort("r0")  # already finished: no-op
    before = [t for t in eng.request_timings() if t["request_id"] != "live"]
    metrics_before = compute_metrics(before)
    assert eng.forget_finished() == 4
    assert list(eng.requests) == ["live"]  # the unfinished one is never dropped
    after = [t for t in eng.request_timings() if t["request_id"] != "live"]
    assert after == before
    assert compute_metrics(after) == metrics_before
    assert {t["finish_reason"] for t in after} == {"length"}
    assert eng.stats()["num_requests"] == 1 and eng.stats()["num_forgotten"] == 4
    assert eng.forget_finished(["live", "nope"]) == 0
    eng.abort("live")
    assert eng.forget_finished(["live"]) == 1 and not eng.requests
    assert eng.request_timings()[-1]["finish_reason"] == "abort"
    assert_no_leaks(eng)


def test_forgotten_id_may_be_reused_and_duplicates_of_held_ones_may_not(tiny_model):
    eng = _engine(tiny_model)
    eng.add_request("a", [1, 2], SP)
    with pytest.raises(InvalidPromptError, match="duplicate request id"):
        eng.add_request("a", [1, 2], SP)
    _drain(eng)
    with pytest.raises(InvalidPromptError, match="duplicate request id"):
        eng.add_request("a", [1, 2], SP)  # finished but still held
    eng.forget_finished()
    eng.add_request("a", [1, 2], SP)
    _drain(eng)
    assert [t["request_id"] for t in eng.request_timings()] == ["a", "a"]


def test_record_is_bounded_and_memory_flat_over_many_requests(tiny_model):
    eng = _engine(tiny_model)
    eng.finished_timings = type(eng.finished_timings)(maxlen=10)
    sizes = []
    for i in range(60):
        eng.add_request(f"r{i}", [1 + i % 50, 2], SamplingParams(temperature=0, max_tokens=2))
        _drain(eng)
        eng.forget_finished()
        sizes.append((len(eng.requests), len(eng.finished_timings)))
    assert sizes[-1] == (0, 10) and max(s[0] for s in sizes) == 0
    assert [t["request_id"] for t in eng.request_timings()] == [f"r{i}" for i in range(50, 60)]
    assert eng.stats()["num_forgotten"] == 60


def test_add_order_survives_forgetting(tiny_model):
    """Request.index is the policies' final tie-break: it must keep growing after requests are
    forgotten (len(requests) would hand out an index twice)."""
    eng = _engine(tiny_model)
    eng.add_request("x", [1], SP)
    eng.add_request("y", [2], SP)
    _drain(eng)
    eng.forget_finished(["x"])
    z = eng.add_request("z", [3], SP)
    assert z.index == 2 > eng.requests["y"].index

"""A bounded soak: 200 requests, ~20% disconnecting clients, ~10% invalid requests, streaming
and not, n = 1 or 2, stop strings -> no 5xx, greedy answers equal in-process generation, no
leaked blocks, counters consistent (accepted = finished + aborted + timed out), and flat memory:
the engine's bookkeeping does not grow with the number of requests served (a trend over 20
samples, labkit.bench.serve_soak.memory_trend), nor does the process's resident memory."""

from __future__ import annotations

import asyncio

import pytest
from serve_helpers import NAME, idle

from labkit.bench.serve_soak import (
    FLAT_LIMITS,
    check_greedy,
    make_cases,
    memory_trend,
    rss_kb,
    run_soak,
)
from labkit.engine.llm import LLM
from labkit.engine.llm_engine import FINISHED_RECORDS, LLMEngine
from labkit.serve.api_server import ServeConfig
from labkit.serve.launcher import ServerThread


def _bookkeeping(e) -> dict[str, float]:
    """Engine-side containers that a leak per request would grow (read on the engine thread)."""
    return {"requests_held": len(e.requests), "timing_records": len(e.finished_timings),
            "waiting_heap": len(e.scheduler.waiting), "bm_seqs": len(e.block_manager.seqs)}


def _soak(labkit_tiny, n, seed, forget=True):
    m, tok = labkit_tiny
    cases = make_cases(n, NAME, seed=seed)
    eng = LLMEngine.from_model(m, tok, block_size=16, num_blocks=256, max_num_seqs=16)
    eng.record_trace = False  # as `labkit serve` (a trace grows by design)
    # the KV pool is committed page by page on first write (labkit.kv.cache.pool_zeros): write
    # it whole first, so that RSS growth counts what requests leave behind, not blocks first used
    kv = eng.executor.runner.kv_cache
    for t in kv.k_caches + kv.v_caches:
        t.zero_()
    with ServerThread(eng, tok, ServeConfig(model_name=NAME)) as srv:
        srv.llm.forget_finished = forget

        async def probe():
            book = await asyncio.to_thread(srv.call, _bookkeeping)
            return {**book, "streams": srv.llm.num_in_flight, "rss_kb": rss_kb()}

        rep = asyncio.run(run_soak(srv.url, cases, concurrency=16, probe=probe))
        idle(srv, timeout=30)
        counts = dict(srv.state.counts)
        held = srv.call(lambda e: len(e.requests))
    return cases, rep, counts, held


@pytest.mark.slow
def test_soak_200_requests(labkit_tiny):
    cases, rep, counts, held = _soak(labkit_tiny, 200, seed=3)
    kinds = [c.kind for c in cases]
    assert 25 <= kinds.count("disconnect") <= 55 and 10 <= kinds.count("invalid") <= 30
    assert rep.num_5xx == 0, rep.statuses
    assert not rep.errors, rep.errors[:3]
    assert rep.invalid_4xx == kinds.count("invalid")
    assert counts["accepted"] == counts["finished"] + counts["aborted"] + counts["timed_out"]
    assert counts["finished"] >= len(rep.valid) and counts["aborted"] >= 1
    assert check_greedy(rep, LLM(labkit_tiny, num_blocks=256)) == len(rep.valid) >= 120
    # flat memory: nothing per request is kept past its answer
    assert held == 0
    trend = memory_trend(rep.samples)
    assert len(rep.samples) == 20 and set(trend) >= {"requests_held", "rss_kb"}
    for key in ("requests_held", "waiting_heap", "bm_seqs", "streams"):
        assert trend[key]["growth_per_1000_requests"] < FLAT_LIMITS["requests_held"], trend
        assert trend[key]["max"] <= 2 * 16, trend  # about what is in flight, never the total
    assert trend["timing_records"]["max"] <= FINISHED_RECORDS  # a bounded record of the past
    assert trend["rss_kb"]["flat"], trend["rss_kb"]  # ~4 MiB / 1000 measured here; limit 16


def test_the_soak_identity_leaves_out_clients_that_left_before_being_accepted():
    """A client that drops mid-body is an abort (reason disconnect_reading_body) but was never
    accepted: accepted = finished + the other aborts (issue 27's disconnect accounting)."""
    from labkit.bench.serve_soak import _metric

    text = ('# TYPE labkit:request_aborted counter\n'
            'labkit:request_aborted_total{model_name="m",reason="disconnect"} 3.0\n'
            'labkit:request_aborted_total{model_name="m",reason="disconnect_reading_body"} 2.0\n')
    assert _metric(text, "labkit:request_aborted_total") == 5.0
    assert _metric(text, "labkit:request_aborted_total", reason="disconnect_reading_body") == 2.0

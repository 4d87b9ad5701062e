"""A bounded soak: 200 requests, ~20% disconnecting clients, ~10% invalid requests, streaming
and not, n = 1 or 2, stop strings -> no 5xx, greedy answers equal in-process generation, no
leaked blocks, counters consistent (accepted = finished + aborted + timed out)."""

from __future__ import annotations

import asyncio

import pytest
from serve_helpers import NAME, idle

from labkit.bench.serve_soak import check_greedy, make_cases, run_soak
from labkit.engine.llm import LLM
from labkit.engine.llm_engine import LLMEngine
from labkit.serve.api_server import ServeConfig
from labkit.serve.launcher import ServerThread


@pytest.mark.slow
def test_soak_200_requests(labkit_tiny):
    m, tok = labkit_tiny
    cases = make_cases(200, NAME, seed=3)
    kinds = [c.kind for c in cases]
    assert 25 <= kinds.count("disconnect") <= 55 and 10 <= kinds.count("invalid") <= 30
    eng = LLMEngine.from_model(m, tok, block_size=16, num_blocks=256, max_num_seqs=16)
    with ServerThread(eng, tok, ServeConfig(model_name=NAME)) as srv:
        rep = asyncio.run(run_soak(srv.url, cases, concurrency=16))
        idle(srv, timeout=30)
        counts = dict(srv.state.counts)
    assert rep.num_5xx == 0, rep.statuses
    assert not rep.errors, rep.errors[:3]
    assert rep.invalid_4xx == kinds.count("invalid")
    assert counts["accepted"] == counts["finished"] + counts["aborted"] + counts["timed_out"]
    assert counts["finished"] >= len(rep.valid) and counts["aborted"] >= 1
    assert check_greedy(rep, LLM(labkit_tiny, num_blocks=256)) == len(rep.valid) >= 120

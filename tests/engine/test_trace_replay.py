"""The trace alone rebuilds the pool at every step; random add/step/abort leaks nothing."""

from __future__ import annotations

import json
import random

import pytest

from labkit.engine.invariants import assert_no_leaks
from labkit.engine.llm_engine import LLMEngine
from labkit.engine.sampling_params import SamplingParams
from labkit.engine.trace import Trace, replay


def live_state(eng: LLMEngine):
    pool = eng.block_manager.pool
    seqs = [s for r in eng.requests.values() for s in r.seqs]
    return {
        "block_tables": {s.seq_id: list(s.block_table) for s in seqs if s.block_table},
        "cpu": {s.seq_id: list(s.cpu_block_table) for s in seqs if s.cpu_block_table},
        "ref_counts": {b: r for b, r in enumerate(pool.ref_counts) if r},
        "cached": set(pool.cached_free), "free": set(pool.free_ids),
        "tokens": {s.seq_id: list(s.token_ids) for s in seqs if s.num_output_tokens},
    }


def random_workload(eng: LLMEngine, seed: int, num_requests: int = 14, check_every_step=True):
    rng = random.Random(seed)
    shared = [rng.randrange(128) for _ in range(9)]
    added = 0
    while added < num_requests or eng.has_unfinished_requests():
        if added < num_requests and rng.random() < 0.5:
            prompt = (shared if rng.random() < 0.5 else []) + [
                rng.randrange(128) for _ in range(rng.randint(1, 12))]
            sp = SamplingParams(n=rng.choice([1, 1, 2]), temperature=rng.choice([0, 0.8]),
                                seed=rng.randrange(100), max_tokens=rng.randint(1, 10),
                                ignore_eos=True)
            eng.add_request(f"q{added}", prompt, sp, priority=rng.randrange(3),
                            cache_salt=rng.choice([None, None, "tenant"]))
            added += 1
        if rng.random() < 0.08 and eng.requests:
            eng.abort(rng.choice(sorted(eng.requests)))
        eng.step()
        if check_every_step and eng.trace.steps:
            snap = replay(eng.trace, -1)
            live = live_state(eng)
            assert snap.block_tables == live["block_tables"]
            assert snap.cpu_block_tables == live["cpu"]
            assert snap.ref_counts == live["ref_counts"]
            assert snap.cached == live["cached"] and snap.free == live["free"]
            for sid, toks in snap.seq_tokens.items():
                assert toks == live["tokens"].get(sid, toks)


@pytest.mark.parametrize("seed,mode", [(0, "recompute"), (1, "swap"), (2, "recompute")])
def test_replay_equals_live_state_every_step(tiny_model, seed, mode):
    eng = LLMEngine.from_model(tiny_model, None, block_size=3, num_blocks=14,
                               preemption_mode=mode, num_cpu_blocks=24 if mode == "swap" else 0,
                               max_num_batched_tokens=16, max_num_seqs=6, policy="priority")
    random_workload(eng, seed)
    steps = eng.trace.steps
    kinds = {e["type"] for s in steps for e in s["events"]}
    assert {"alloc", "free", "prefix_hit", "evict"} <= kinds
    assert any(s["preempted"] for s in steps)
    # nothing leaked: every block free or cached with ref count 0
    assert_no_leaks(eng)
    reasons = {f["reason"] for s in steps for f in s["finished"]}
    assert "length" in reasons
    # JSON round trip and replay of an earlier step from the decoded trace
    back = Trace.from_dict(json.loads(eng.trace.to_json()))
    assert replay(back, 5) == replay(eng.trace, 5)


def test_timings_are_ordered(tiny_model):
    eng = LLMEngine.from_model(tiny_model, None, block_size=4, max_num_seqs=3)
    random_workload(eng, 3, num_requests=8, check_every_step=False)
    for t in eng.request_timings():
        if t["finish_reason"] == "abort" or not t["token_times"]:
            continue
        assert t["arrival_time"] <= t["first_scheduled_time"] <= t["first_token_time"]
        assert t["token_times"] == sorted(t["token_times"])
        assert t["token_times"][-1] <= t["finish_time"]
        assert len(t["token_times"]) == t["num_output_tokens"]

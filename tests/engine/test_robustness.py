"""Nothing is lost: failed steps, interrupts and aborts in every state free every block.

The invariant helper (labkit.engine.invariants) recounts ref counts from the sequences' block
tables, so it is an independent check of the pool's own counters; the first test shows it
catches a leak and a wrong ref count (it can fail).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from labkit.engine.invariants import KVInvariantError, assert_no_leaks, check_kv_invariants
from labkit.engine.llm import LLM
from labkit.engine.llm_engine import LLMEngine
from labkit.engine.sampling_params import SamplingParams
from labkit.engine.trace import replay
from labkit.errors import EngineStepError

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def run(eng: LLMEngine, max_steps: int = 500) -> set[str]:
    """Step to the end (checking the invariants every step); returns the failed request ids."""
    failed: set[str] = set()
    for _ in range(max_steps):
        if not eng.has_unfinished_requests():
            return failed
        try:
            eng.step()
        except EngineStepError as e:
            failed.update(e.request_ids)
        check_kv_invariants(eng)
    raise AssertionError(f"no progress after {max_steps} steps: {eng.stats()}")


def replay_matches_live(eng: LLMEngine) -> None:
    snap, pool = replay(eng.trace, -1), eng.block_manager.pool
    assert snap.ref_counts == {b: r for b, r in enumerate(pool.ref_counts) if r}
    assert snap.cached == set(pool.cached_free) and snap.free == set(pool.free_ids)
    assert snap.cpu_block_tables == {s.seq_id: s.cpu_block_table for r in eng.requests.values()
                                     for s in r.seqs if s.cpu_block_table}


def test_invariant_helper_detects_leaks(tiny_model):
    eng = LLMEngine.from_model(tiny_model, None, block_size=4, num_blocks=16)
    eng.add_request("a", [1, 2, 3, 4, 5], GREEDY)
    eng.step()
    check_kv_invariants(eng)  # mid-flight: consistent
    with pytest.raises(KVInvariantError, match="unfinished"):
        assert_no_leaks(eng)
    seq = eng.requests["a"].seqs[0]
    eng.block_manager.pool.ref_counts[seq.block_table[0]] += 1  # a reference nobody holds
    with pytest.raises(KVInvariantError, match="ref count"):
        check_kv_invariants(eng)
    eng.block_manager.pool.ref_counts[seq.block_table[0]] -= 1
    run(eng)
    assert_no_leaks(eng)
    eng.block_manager.pool.allocate()  # a block allocated and never released
    with pytest.raises(KVInvariantError):
        assert_no_leaks(eng)


def test_abort_while_swapped_out_is_freed_and_traced(tiny_model, reference):
    eng = LLMEngine.from_model(tiny_model, None, block_size=4, num_blocks=10,
                               preemption_mode="swap", num_cpu_blocks=20)
    prompts = {f"r{i}": [1 + i] * 6 for i in range(3)}
    for rid, p in prompts.items():
        eng.add_request(rid, p, SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    victim = None
    while eng.has_unfinished_requests():
        eng.step()
        check_kv_invariants(eng)
        replay_matches_live(eng)  # was: replay kept the aborted sequence's CPU blocks
        if victim is None and eng.scheduler.swapped:  # logged with the next step's record
            victim = eng.scheduler.swapped[0].request_id
            assert eng.abort(victim)
            assert eng.block_manager.cpu_pool.num_used == 0
    assert victim is not None
    assert_no_leaks(eng)
    for rid, p in prompts.items():
        if rid != victim:
            assert eng.requests[rid].seqs[0].output_token_ids == reference(
                p, 20, ignore_eos=True)


def _inject(eng: LLMEngine, where: str, at: int, exc: BaseException, monkeypatch=None) -> None:
    """Make the ``at``-th call of one engine stage raise ``exc`` ("model": an MLP of the
    model itself, halfway through the forward, after some layers wrote their KV)."""
    ex = eng.executor
    obj, name = {"forward": (ex.runner, "forward"), "block_ops": (ex, "apply_block_ops"),
                 "update": (eng.scheduler, "_append"),
                 "model": (ex.runner.model.model.layers[-1].mlp, "forward"),
                 }[where]
    orig, calls = getattr(obj, name), [0]

    def flaky(*a, **kw):
        calls[0] += 1
        if calls[0] == at:
            raise exc
        return orig(*a, **kw)

    if monkeypatch is not None:  # a shared module: undo after the test
        monkeypatch.setattr(obj, name, flaky)
    else:
        setattr(obj, name, flaky)


@pytest.mark.parametrize("where,at", [("forward", 2), ("forward", 9), ("block_ops", 7),
                                      ("update", 5), ("model", 6)])
@pytest.mark.parametrize("spec", [None, "ngram"])
def test_failed_step_fails_only_its_requests(tiny_model, reference, where, at, spec,
                                             monkeypatch):
    """A step that raises after scheduling fails the requests it touched (their block copies
    and swaps may be half applied) and frees them; every other request still finishes with the
    reference output. Before: the exception escaped with blocks held, and a retry reused KV
    whose copy-on-write / swap-out copies had been dropped."""
    kw = {"speculative_config": {"method": "ngram", "num_speculative_tokens": 3}} if spec else {}
    eng = LLMEngine.from_model(tiny_model, None, block_size=4, num_blocks=14,
                               max_num_batched_tokens=12, preemption_mode="swap",
                               num_cpu_blocks=30, max_num_seqs=4, **kw)
    prompts = {f"r{i}": [3 + i, 4, 5, 3 + i, 4, 5, 3 + i] * (1 + i % 2) for i in range(6)}
    for rid, p in prompts.items():
        eng.add_request(rid, p, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                               n=2 if rid == "r1" else 1))
    _inject(eng, where, at, RuntimeError("injected"), monkeypatch)
    failed = run(eng)
    assert failed and failed < set(prompts)
    assert eng.scheduler.num_preemptions  # the pool is tight: swaps are in flight
    assert_no_leaks(eng)
    replay_matches_live(eng)
    for rid, p in prompts.items():
        req = eng.requests[rid]
        reasons = {s.finish_reason for s in req.seqs}
        if rid in failed:
            assert reasons == {"abort"}
        else:
            assert reasons == {"length"}
            for s in req.seqs:
                assert s.output_token_ids == reference(p, 12, ignore_eos=True), s.seq_id


def test_interrupted_generate_frees_everything(tiny_model, reference, monkeypatch):
    """Ctrl-C in a notebook mid-generate: this call's requests are aborted, the next call runs
    only its own requests. Before: they stayed queued and ran (and held blocks) next time."""
    llm = LLM.from_model(tiny_model, block_size=4, num_blocks=32)
    prompts = [[7, 8, 9], [10, 11, 12, 13, 14], [7, 8, 9, 1]]
    _inject(llm.llm_engine, "model", 3, KeyboardInterrupt(), monkeypatch)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)
    assert_no_leaks(llm.llm_engine)
    out = llm.generate(prompt_token_ids=prompts[:1], sampling_params=GREEDY)
    assert out[0].outputs[0].token_ids == reference(prompts[0], 12, ignore_eos=True)
    assert_no_leaks(llm.llm_engine)


def test_abort_in_every_state_frees_everything(tiny_model):
    """Abort while waiting, mid chunked prefill, decoding, swapped out, after a fork (n > 1)
    and between speculative steps; the pool ends empty every time."""
    eng = LLMEngine.from_model(tiny_model, None, block_size=4, num_blocks=12,
                               max_num_batched_tokens=5, preemption_mode="swap",
                               num_cpu_blocks=8, max_num_seqs=3,
                               speculative_config={"method": "ngram",
                                                   "num_speculative_tokens": 2})
    states = set()
    for i in range(12):
        eng.add_request(f"r{i}", [1, 2, 3] * (1 + i % 4),
                        SamplingParams(temperature=0, max_tokens=16, n=1 + i % 2))
    while eng.has_unfinished_requests():
        eng.step()
        check_kv_invariants(eng)
        sch = eng.scheduler
        pick = None
        if sch.swapped and "swapped" not in states:
            pick, state = sch.swapped[0], "swapped"
        for s in sch.running:
            st = "prefill" if s.is_prefill and s.num_computed_tokens else (
                "forked" if s.request.n > 1 else "decode")
            if pick is None and st not in states and s.num_computed_tokens:
                pick, state = s, st
        if pick is None and sch.num_waiting and "waiting" not in states:
            pick = next((s for _, s in sch.waiting if not s.is_finished), None)
            state = "waiting"
        if pick is not None:
            states.add(state)
            eng.abort(pick.request_id)
    assert {"swapped", "prefill", "decode", "forked", "waiting"} <= states
    assert_no_leaks(eng)
    replay_matches_live(eng)


SWAP_UNDER_O = """
import torch
from labkit.engine.llm_engine import LLMEngine
from labkit.engine.sampling_params import SamplingParams
from labkit.model.generate import generate
from labkit.model.testing import tiny_model
m = tiny_model()
e = LLMEngine.from_model(m, None, block_size=4, num_blocks=10, preemption_mode="swap",
                         num_cpu_blocks=20)
for i in range(3):
    e.add_request(f"r{i}", [1 + i] * 6, SamplingParams(temperature=0, max_tokens=20,
                                                       ignore_eos=True))
while e.has_unfinished_requests():
    e.step()
assert e.scheduler.num_preemptions
ok = all(q.seqs[0].output_token_ids == generate(m, q.prompt_token_ids, 20, ignore_eos=True)
         for q in e.requests.values())
print("MATCH" if ok else "MISMATCH")
"""


def test_swap_in_works_under_python_O():
    """``python -O`` strips asserts; swap-in once allocated its blocks inside one (IndexError
    mid-step under -O)."""
    r = subprocess.run([sys.executable, "-O", "-c", SWAP_UNDER_O], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0 and r.stdout.split() == ["MATCH"], r.stderr[-2000:]

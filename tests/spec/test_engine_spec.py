"""Speculative decoding through labkit.LLM: greedy output equals the reference token for token,
blocks are all returned, bad configs fail at construction, the trace records every proposal."""

from __future__ import annotations

import random

import pytest
import torch

from labkit import LLM, SamplingParams
from labkit.engine.invariants import assert_no_leaks
from labkit.model.generate import generate
from labkit.spec import SpeculativeConfigError
from labkit.spec.theory import trace_acceptance

PROMPTS = [[1, 5, 9, 5, 9, 5, 9, 17, 3], list(range(10, 40)), [7] * 5 + [8, 9],
           [100, 101, 102, 100, 101, 102, 100], [3, 3, 4]]


def _cfg(method, drafts, gamma, draft="noisy"):
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": gamma, "prompt_lookup_max": 3}
    return {"method": "draft_model", "model": drafts[draft], "num_speculative_tokens": gamma}


def _greedy(max_tokens, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def _assert_all_blocks_returned(llm):
    assert_no_leaks(llm.llm_engine)  # ref counts recounted from block tables, swap space empty


@pytest.fixture(scope="module")
def references(target):
    return [generate(target, p, 40, ignore_eos=True) for p in PROMPTS]


@pytest.mark.parametrize("gamma", [1, 3, 5])
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_greedy_equals_reference_concurrent(target, drafts, references, method, gamma):
    llm = LLM(target, block_size=4, speculative_config=_cfg(method, drafts, gamma))
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=_greedy(40))
    assert [o.outputs[0].token_ids for o in outs] == references
    ex = llm.llm_engine.executor
    assert ex.num_draft_tokens > 0 and ex.num_accepted_tokens > 0
    # the trace saw the speculation: every decode step of every sequence has a record
    stats = trace_acceptance(llm.llm_engine.trace.to_dict())
    assert stats.num_accepted == ex.num_accepted_tokens
    _assert_all_blocks_returned(llm)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
@pytest.mark.parametrize("mode,gamma", [("recompute", 1), ("recompute", 5), ("swap", 3)])
def test_greedy_under_preemption(target, drafts, references, method, mode, gamma):
    """A pool too small for all five sequences forces preemption while speculating."""
    llm = LLM(target, block_size=4, num_blocks=24, num_cpu_blocks=64 if mode == "swap" else 0,
              preemption_mode=mode, speculative_config=_cfg(method, drafts, gamma))
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=_greedy(40))
    assert [o.outputs[0].token_ids for o in outs] == references
    assert llm.llm_engine.stats()["num_preemptions"] > 0
    _assert_all_blocks_returned(llm)


@pytest.mark.parametrize("method,gamma,draft", [("ngram", 1, None), ("ngram", 5, None),
                                                ("draft_model", 3, "noisy"),
                                                ("draft_model", 5, "self")])
def test_greedy_with_prefix_cache_hits(target, drafts, method, gamma, draft):
    shared = list(range(50, 70))  # 5 full blocks of 4
    prompts = [shared + [1, 2], shared + [3], shared + [4, 4, 4]]
    want = [generate(target, p, 24, ignore_eos=True) for p in prompts]
    llm = LLM(target, block_size=4, enable_prefix_caching=True,
              speculative_config=_cfg(method, drafts, gamma, draft=draft))
    first = llm.generate(prompt_token_ids=prompts[:1], sampling_params=_greedy(24))
    rest = llm.generate(prompt_token_ids=prompts, sampling_params=_greedy(24))
    assert first[0].outputs[0].token_ids == want[0]
    assert [o.outputs[0].token_ids for o in rest] == want
    assert all(o.num_cached_tokens >= 16 for o in rest)
    _assert_all_blocks_returned(llm)


def test_greedy_n_gt_1_and_stop_tokens(target, drafts, references):
    """Forked samples speculate independently; a stop token inside an accepted run ends it."""
    llm = LLM(target, block_size=4, speculative_config=_cfg("draft_model", drafts, 4, "self"))
    outs = llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=_greedy(40, n=2))
    for o, ref in zip(outs, references):
        assert [c.token_ids for c in o.outputs] == [ref, ref]
    stop = references[1][9]
    want = generate(target, PROMPTS[1], 40, stop_token_ids=[stop], ignore_eos=True)
    out = llm.generate(prompt_token_ids=[PROMPTS[1]],
                       sampling_params=_greedy(40, stop_token_ids=[stop]))
    assert out[0].outputs[0].token_ids == want and want[-1] == stop
    _assert_all_blocks_returned(llm)


def test_rejections_and_aborts_return_every_block(target, drafts):
    """A random draft (almost everything rejected), sampling, and aborts at random steps."""
    llm = LLM(target, block_size=4, num_blocks=48,
              speculative_config=_cfg("draft_model", drafts, 5, draft="small"))
    eng = llm.llm_engine
    rng = random.Random(0)
    live = []
    for i in range(24):
        p = [rng.randrange(128) for _ in range(rng.randint(3, 20))]
        sp = SamplingParams(temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randint(5, 30),
                            seed=i, ignore_eos=True)
        eng.add_request(f"r{i}", p, sp)
        live.append(f"r{i}")
        for _ in range(rng.randint(0, 3)):
            eng.step()
        if rng.random() < 0.3:
            eng.abort(live.pop(rng.randrange(len(live))))
    while eng.has_unfinished_requests():
        eng.step()
    ex = eng.executor
    assert ex.num_draft_tokens - ex.num_accepted_tokens > 100  # many rejections happened
    assert any(f["reason"] == "abort" for s in eng.trace.steps for f in s["finished"])
    _assert_all_blocks_returned(llm)


def test_seeded_sampling_is_deterministic(target, drafts):
    sp = [SamplingParams(temperature=0.8, top_k=20, top_p=0.9, max_tokens=20, seed=s,
                         ignore_eos=True) for s in range(4)]
    outs = []
    for _ in range(2):
        llm = LLM(target, block_size=4, speculative_config=_cfg("draft_model", drafts, 3))
        outs.append([o.outputs[0].token_ids for o in
                     llm.generate(prompt_token_ids=PROMPTS[:4], sampling_params=sp)])
    assert outs[0] == outs[1]
    assert len({tuple(t) for t in outs[0]}) > 1


def test_trace_records_proposed_and_accepted(target, drafts, references):
    llm = LLM(target, block_size=4, speculative_config=_cfg("ngram", drafts, 3))
    llm.generate(prompt_token_ids=[PROMPTS[0]], sampling_params=_greedy(40))
    steps = llm.llm_engine.trace.to_dict()["steps"]
    emitted = 0
    for st in steps:
        for rec in st["spec"]:
            assert set(rec) == {"request_id", "seq_id", "proposed", "accepted"}
            assert 0 <= rec["accepted"] <= len(rec["proposed"]) <= 3
            out = st["outputs"][rec["seq_id"]]
            assert out[:rec["accepted"]] == rec["proposed"][:rec["accepted"]]
            emitted += len(out)
    assert emitted == 39  # every token after the prefill's came out of a verify step
    assert any(rec["accepted"] > 0 for st in steps for rec in st["spec"])


def test_construction_errors(target, drafts, build_model):
    build = build_model
    with pytest.raises(SpeculativeConfigError, match="num_speculative_tokens"):
        LLM(target, speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    with pytest.raises(SpeculativeConfigError, match="unknown speculative method"):
        LLM(target, speculative_config={"method": "medusa", "num_speculative_tokens": 2})
    with pytest.raises(SpeculativeConfigError, match="vocabulary"):
        LLM(target, speculative_config={"method": "draft_model", "model": build(3, vocab_size=96),
                                        "num_speculative_tokens": 2})
    with pytest.raises(SpeculativeConfigError, match="draft context"):
        LLM(target, speculative_config={
            "method": "draft_model", "model": build(3, max_position_embeddings=128),
            "num_speculative_tokens": 2})
    with pytest.raises(SpeculativeConfigError, match="needs \"model\""):
        LLM(target, speculative_config={"method": "draft_model", "num_speculative_tokens": 2})
    with pytest.raises(SpeculativeConfigError, match="unknown speculative_config keys"):
        LLM(target, speculative_config={"method": "ngram", "gamma": 2})
    for bad in ({"num_speculative_tokens": True}, {"num_speculative_tokens": 2.0},
                {"prompt_lookup_max": "4"}):  # was: bool accepted as γ=1, TypeError
        with pytest.raises(SpeculativeConfigError):
            LLM(target, speculative_config={"method": "ngram", "num_speculative_tokens": 2,
                                            **bad})
    with pytest.raises(SpeculativeConfigError, match="must be a dict"):
        LLM(target, speculative_config="ngram")
    # a shorter max_model_len makes the short-context draft acceptable
    LLM(target, max_model_len=128, speculative_config={
        "method": "draft_model", "model": build(3, max_position_embeddings=128),
        "num_speculative_tokens": 2})
    assert torch.is_grad_enabled()


def test_greedy_with_triton_backend(target, drafts, references):
    """The Triton paged kernels (interpreted on CPU) serve both the verify and the draft KV."""
    llm = LLM(target, block_size=4, attention_backend="triton",
              speculative_config=_cfg("draft_model", drafts, 3))
    outs = llm.generate(prompt_token_ids=PROMPTS[:2], sampling_params=_greedy(10))
    assert [o.outputs[0].token_ids for o in outs] == [r[:10] for r in references[:2]]
    assert llm.llm_engine.executor.num_accepted_tokens > 0
    _assert_all_blocks_returned(llm)


def test_trace_replay_matches_live_block_tables(target, drafts):
    """Replaying the trace rebuilds every block table and the output tokens, step by step,
    while sequences speculate and get rolled back; and rejected drafts never pile up blocks:
    a sequence holds at most the blocks for its tokens plus the γ-slot lookahead reservation
    (a block emptied by a rollback is reused by the next step's drafts, or freed at the end)."""
    from labkit.engine.trace import replay

    llm = LLM(target, block_size=4, num_blocks=40,
              speculative_config=_cfg("draft_model", drafts, 5, draft="small"))
    eng = llm.llm_engine
    for i, p in enumerate(PROMPTS):
        eng.add_request(f"r{i}", p, _greedy(30))
    while eng.has_unfinished_requests():
        eng.step()
        snap = replay(eng.trace, -1)
        live = {s.seq_id: s for s in eng.block_manager.seqs.values()}
        assert {k: v for k, v in snap.block_tables.items() if v} == \
            {k: list(s.block_table) for k, s in live.items() if s.block_table}
        for sid, s in live.items():
            if sid in snap.seq_tokens:
                assert snap.seq_tokens[sid] == s.token_ids
            assert len(s.block_table) <= -(-(s.num_tokens + 5) // 4)
    assert eng.executor.num_draft_tokens > 2 * eng.executor.num_accepted_tokens  # rejections
    snap = replay(eng.trace, -1)
    assert not any(snap.block_tables.values()) and not snap.ref_counts


class LetterTokenizer:
    """Token t decodes to one letter: enough to put stop strings mid speculative run."""

    def decode(self, ids):
        return "".join(chr(97 + t % 26) for t in ids)


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_stop_string_inside_accepted_run_cuts_token_ids(target, drafts, references, method):
    """A verify step appends several tokens; a stop string completed by the first of them
    must end the output there, exactly as plain decoding does (before: the rest of the
    accepted run stayed in token_ids, so spec and plain outputs differed)."""
    tok = LetterTokenizer()
    stops = []
    for ref in references:
        text = tok.decode(ref)
        stops.append(text[5:7] if text[5:7] not in text[:6] else text[5:8])
    plain = LLM.from_model(target, tok, block_size=4)
    spec = LLM.from_model(target, tok, block_size=4,
                          speculative_config=_cfg(method, drafts, 5, draft="self"))
    for p, stop in zip(PROMPTS, stops):
        sp = _greedy(40, stop=[stop])
        a = plain.generate(prompt_token_ids=[p], sampling_params=sp)[0].outputs[0]
        b = spec.generate(prompt_token_ids=[p], sampling_params=sp)[0].outputs[0]
        assert a.finish_reason == b.finish_reason == "stop" and stop not in a.text
        assert b.token_ids == a.token_ids and b.text == a.text
    assert sum(r["accepted"] > 1 for st in spec.llm_engine.trace.steps for r in st["spec"])
    _assert_all_blocks_returned(spec)

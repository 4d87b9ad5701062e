"""Every engine path equals the reference ``generate`` token for token."""

from __future__ import annotations

import copy

import pytest

from labkit.engine.invariants import assert_no_leaks
from labkit.engine.llm import LLM
from labkit.engine.sampling_params import SamplingParams

MAX_NEW = 10
# issue 31's step cures, each through the same checks as the plain engine: fused layers with
# compilation (decode steps as full graphs, the rest piecewise), async scheduling, and all three
COMPILED = dict(fused=True, compile=True, compile_sizes=(1, 2, 4))
CURES = {"plain": {}, "compiled": COMPILED, "async": dict(async_scheduling=True),
         "all": dict(COMPILED, async_scheduling=True)}


def run(model, prompts, params=None, cures="plain", **kw):
    if CURES[cures].get("compile") or CURES[cures].get("fused"):
        model = copy.deepcopy(model)  # both change the model object (a session fixture)
    llm = LLM.from_model(model, None, **CURES[cures], **kw)
    params = params or SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    eng = llm.llm_engine
    assert_no_leaks(eng)  # everything released (free or cached), swap space empty
    return outs, eng


def check_greedy(outs, prompts, reference, max_new=MAX_NEW):
    for p, o in zip(prompts, outs):
        assert o.finished and o.prompt_token_ids == p
        for c in o.outputs:
            assert c.token_ids == reference(p, max_new, ignore_eos=True)


@pytest.mark.parametrize("block_size", [1, 16, 5])
@pytest.mark.parametrize("chunked", [True, False])
@pytest.mark.parametrize("caching", [True, False])
def test_greedy_matches_reference(tiny_model, prompts, reference, block_size, chunked, caching):
    budget = 24 if chunked else 256  # 24 forces multi-step chunked prefills
    outs, eng = run(tiny_model, prompts, block_size=block_size, enable_chunked_prefill=chunked,
                    enable_prefix_caching=caching, max_num_batched_tokens=budget,
                    max_num_seqs=4)  # later prompts are admitted after their prefixes exist
    check_greedy(outs, prompts, reference)
    hit = eng.stats()["prefix_hit_tokens"]
    assert (hit > 0) == caching  # the shared prefix and the repeated prompt do hit


def test_fully_cached_block_aligned_prompt(tiny_model, prompts, reference):
    llm = LLM.from_model(tiny_model, None, block_size=8)
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    p = prompts[1]  # 16 tokens = 2 full blocks
    first = llm.generate(prompt_token_ids=[p], sampling_params=sp)[0]
    second = llm.generate(prompt_token_ids=[p], sampling_params=sp)[0]
    assert second.num_cached_tokens == 8  # the last block is recomputed for logits
    assert first.outputs[0].token_ids == second.outputs[0].token_ids == reference(
        p, MAX_NEW, ignore_eos=True)


@pytest.mark.parametrize("policy", ["fcfs", "priority", "sjf"])
def test_policies(tiny_model, prompts, reference, policy):
    llm = LLM.from_model(tiny_model, None, block_size=4, policy=policy, max_num_seqs=3)
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp,
                        priority=list(range(len(prompts), 0, -1)))
    check_greedy(outs, prompts, reference)


@pytest.mark.parametrize("cures", list(CURES))
@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tiny_pool_preemption(tiny_model, prompts, reference, mode, cures):
    outs, eng = run(tiny_model, prompts, block_size=4, num_blocks=16, preemption_mode=mode,
                    num_cpu_blocks=32 if mode == "swap" else 0, max_num_batched_tokens=32,
                    cures=cures)
    check_greedy(outs, prompts, reference)
    modes = {p["mode"] for s in eng.trace.steps for p in s["preempted"]}
    assert modes == {mode}


def test_static_batching(tiny_model, prompts, reference):
    outs, eng = run(tiny_model, prompts, block_size=4, batching="static", max_num_seqs=3)
    check_greedy(outs, prompts, reference)


@pytest.mark.parametrize("cures", list(CURES))
def test_n_samples_greedy_share_blocks(tiny_model, prompts, reference, cures):
    sp = SamplingParams(n=3, temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs, eng = run(tiny_model, prompts[:4], sp, block_size=4, enable_prefix_caching=False,
                    cures=cures)
    check_greedy(outs, prompts[:4], reference)
    kinds = {e["type"] for s in eng.trace.steps for e in s["events"]}
    assert {"fork", "cow"} <= kinds


@pytest.mark.parametrize("kw", [dict(block_size=16), dict(block_size=3, num_blocks=20,
                                                          max_num_batched_tokens=16)])
def test_seeded_sampling_matches_reference(tiny_model, prompts, reference, kw):
    sp = SamplingParams(n=2, temperature=0.9, top_k=20, top_p=0.9, seed=123,
                        max_tokens=MAX_NEW, ignore_eos=True)
    outs, _ = run(tiny_model, prompts[:5], sp, **kw)
    for p, o in zip(prompts[:5], outs):
        for i, c in enumerate(o.outputs):
            want = reference(p, MAX_NEW, temperature=0.9, top_k=20, top_p=0.9, seed=123 + i,
                             ignore_eos=True)
            assert c.token_ids == want
    assert outs[0].outputs[0].token_ids != outs[0].outputs[1].token_ids


def test_stop_token_and_eos(tiny_model, prompts, reference):
    ref = reference(prompts[0], MAX_NEW, ignore_eos=True)
    stop = ref[3]
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, stop_token_ids=[stop],
                        ignore_eos=True)
    out, _ = run(tiny_model, prompts[:1], sp)
    c = out[0].outputs[0]
    assert c.token_ids == ref[: ref.index(stop) + 1] and c.finish_reason == "stop"


@pytest.mark.parametrize("block_size", [4, 16])
def test_per_layer_sliding_windows_match_reference(prompts, block_size):
    """Alternating sliding (window 5) and full layers through the paged engine, prefix caching on
    and chunked prefill in 7-token steps (prompts up to 40 tokens, far past the window): each
    layer's window reaches the backend, every token equals the reference."""
    from labkit.model.generate import generate
    from labkit.model.testing import tiny_model

    model = tiny_model(2, num_hidden_layers=3, sliding_window=5,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    outs, eng = run(model, prompts, block_size=block_size, enable_chunked_prefill=True,
                    enable_prefix_caching=True, max_num_batched_tokens=7, max_num_seqs=4)
    check_greedy(outs, prompts, lambda p, n, **kw: generate(model, p, n, **kw))
    assert eng.stats()["prefix_hit_tokens"] > 0

"""SamplingParams(logprobs=k, prompt_logprobs=k) through the paged engine equal log_softmax of
the reference model's logits (one contiguous-cache forward over prompt + output)."""

from __future__ import annotations

import pytest
import torch

from labkit.engine.invariants import assert_no_leaks
from labkit.engine.llm import LLM
from labkit.engine.outputs import Logprob
from labkit.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from labkit.errors import SamplingParamsError
from labkit.model.generate import ContiguousKVCache
from labkit.model.sampling import processed_logprobs

ATOL = 1e-4


@torch.inference_mode()
def reference_logits(model, ids: list[int]) -> torch.Tensor:
    """[T, V] float32 logits of every position, from the reference forward."""
    cache = ContiguousKVCache(model, 1, len(ids))
    return model(torch.tensor([ids]), torch.arange(len(ids))[None], cache)[0].float()


def expected_logprobs(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """The distribution sampled from, written out independently of the engine's helper."""
    if sp.temperature == 0:
        return torch.log_softmax(logits, -1)
    x = logits / sp.temperature
    if sp.top_k > 0:
        kth = torch.topk(x, sp.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    return torch.log_softmax(x, -1)


def check_entry(entry: dict[int, Logprob], token: int, want: torch.Tensor, k: int) -> None:
    assert next(iter(entry)) == token  # the chosen token first
    assert entry[token].logprob == pytest.approx(float(want[token]), abs=ATOL)
    v = want[token]  # near-ties (within float noise) may rank either way
    assert int((want > v + ATOL).sum()) + 1 <= entry[token].rank <= int((want >= v - ATOL).sum())
    top = torch.topk(want, k)
    assert len(entry) in (k, k + 1)
    for r, (v, i) in enumerate(zip(top.values.tolist(), top.indices.tolist()), 1):
        assert i in entry and entry[i].logprob == pytest.approx(v, abs=ATOL)
        if i != token:
            assert entry[i].rank == r


def check_sample_logprobs(model, prompt, completion, sp):
    ids = prompt + completion.token_ids
    logits = reference_logits(model, ids)
    assert len(completion.logprobs) == len(completion.token_ids)
    for t, (tok, entry) in enumerate(zip(completion.token_ids, completion.logprobs)):
        want = expected_logprobs(logits[len(prompt) + t - 1], sp)
        check_entry(entry, tok, want, sp.logprobs)


def check_prompt_logprobs(model, prompt, plps, k):
    logits = torch.log_softmax(reference_logits(model, prompt), -1)
    assert len(plps) == len(prompt) and plps[0] is None
    for p in range(1, len(prompt)):
        check_entry(plps[p], prompt[p], logits[p - 1], k)


def mixed_params() -> list[SamplingParams]:
    kw = dict(max_tokens=8, ignore_eos=True)
    return [SamplingParams(temperature=0, logprobs=5, **kw),
            SamplingParams(temperature=0.8, seed=3, logprobs=3, **kw),
            SamplingParams(temperature=0, **kw),  # no logprobs: pays nothing, gets None
            SamplingParams(temperature=1.3, top_k=7, seed=5, logprobs=MAX_LOGPROBS, **kw),
            SamplingParams(temperature=0.7, seed=9, **kw),
            SamplingParams(temperature=0, logprobs=0, **kw),
            SamplingParams(temperature=1.0, seed=1, logprobs=2, n=2, **kw)]


@pytest.mark.parametrize("caching", [False, True])
def test_sample_logprobs_equal_reference(tiny_model, prompts, reference, caching):
    """A mixed batch (greedy, seeded, top-k, n=2, with and without logprobs), chunked prefill."""
    llm = LLM.from_model(tiny_model, None, block_size=4, enable_prefix_caching=caching,
                         max_num_batched_tokens=24, max_num_seqs=6)
    ps = prompts[:7]
    sps = mixed_params()
    outs = llm.generate(prompt_token_ids=ps, sampling_params=sps)
    assert_no_leaks(llm.llm_engine)
    for p, sp, o in zip(ps, sps, outs):
        assert o.prompt_logprobs is None
        for c in o.outputs:
            seed = None if sp.seed is None else sp.seed + c.index
            assert c.token_ids == reference(p, 8, temperature=sp.temperature, top_k=sp.top_k,
                                            seed=seed, ignore_eos=True)
            if sp.logprobs is None:
                assert c.logprobs is None
            else:
                check_sample_logprobs(tiny_model, p, c, sp)


def test_top_p_logprobs_are_the_renormalised_nucleus(tiny_model, prompts):
    sp = SamplingParams(temperature=0.9, top_p=0.5, seed=2, logprobs=4, max_tokens=6,
                        ignore_eos=True)
    o = LLM.from_model(tiny_model, None, block_size=4).generate(
        prompt_token_ids=[prompts[0]], sampling_params=sp)[0].outputs[0]
    for entry, tok in zip(o.logprobs, o.token_ids):
        probs = torch.tensor([lp.logprob for lp in entry.values()]).exp()
        assert entry[tok].logprob > float("-inf")  # the sampled token was in the nucleus
        assert float(probs.sum()) <= 1 + 1e-5


@pytest.mark.parametrize("caching", [False, True])
def test_prompt_logprobs_equal_reference(tiny_model, prompts, caching):
    """With caching on, the shared prefix is cached by the first request, yet the
    prompt_logprobs request recomputes it (no hit) and still scores every prompt token."""
    llm = LLM.from_model(tiny_model, None, block_size=4, enable_prefix_caching=caching,
                         max_num_batched_tokens=16, max_num_seqs=4)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    warm = llm.generate(prompt_token_ids=[prompts[2]], sampling_params=sp)[0]
    asks = [SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=3,
                           logprobs=1),
            SamplingParams(temperature=0.5, seed=4, max_tokens=3, prompt_logprobs=0),
            sp]
    ps = [prompts[5], prompts[4], prompts[8]]  # 32 and 33 tokens: several chunks
    outs = llm.generate(prompt_token_ids=ps, sampling_params=asks)
    assert_no_leaks(llm.llm_engine)
    assert warm.prompt_logprobs is None
    check_prompt_logprobs(tiny_model, ps[0], outs[0].prompt_logprobs, 3)
    check_prompt_logprobs(tiny_model, ps[1], outs[1].prompt_logprobs, 0)
    check_sample_logprobs(tiny_model, ps[0], outs[0].outputs[0], asks[0])
    assert outs[0].num_cached_tokens == 0 and outs[1].num_cached_tokens == 0
    assert outs[2].prompt_logprobs is None
    assert (outs[2].num_cached_tokens > 0) == caching  # others still hit the prefix


def test_prompt_logprobs_of_a_one_token_prompt(tiny_model):
    sp = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2)
    o = LLM.from_model(tiny_model, None).generate(prompt_token_ids=[[7]], sampling_params=sp)[0]
    assert o.prompt_logprobs == [None]


def test_prompt_logprobs_survive_recompute_preemption(tiny_model, prompts):
    """A pool too small for everyone preempts by recompute: the recomputed prompt is not
    scored twice, and the numbers are unchanged."""
    llm = LLM.from_model(tiny_model, None, block_size=4, num_blocks=24, max_num_seqs=4,
                         preemption_mode="recompute")
    sps = [SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, prompt_logprobs=1,
                          logprobs=2) for _ in range(4)]
    ps = [prompts[i] for i in (0, 2, 6, 8)]
    outs = llm.generate(prompt_token_ids=ps, sampling_params=sps)
    assert llm.llm_engine.scheduler.num_preemptions > 0
    for p, sp, o in zip(ps, sps, outs):
        check_prompt_logprobs(tiny_model, p, o.prompt_logprobs, 1)
        check_sample_logprobs(tiny_model, p, o.outputs[0], sp)


@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
@pytest.mark.parametrize("bad", [-1, MAX_LOGPROBS + 1, 1.5, True, "3"])
def test_bad_values_raise_a_named_error(field, bad):
    with pytest.raises(SamplingParamsError, match=field):
        SamplingParams(**{field: bad})


def test_decoded_tokens_filled_with_a_tokenizer(tiny_model):
    class Tok:
        def encode(self, text):
            return [ord(c) % 128 for c in text]

        def decode(self, ids):
            return "".join(chr(65 + i % 26) for i in ids)

    llm = LLM.from_model(tiny_model, Tok())
    o = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=3, logprobs=2,
                                               prompt_logprobs=1, ignore_eos=True))[0]
    for entry in o.outputs[0].logprobs + o.prompt_logprobs[1:]:
        assert all(lp.decoded_token == chr(65 + t % 26) for t, lp in entry.items())


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculative_decoding_returns_the_same_logprobs(tiny_model, prompts, temperature):
    """Speculation returns what plain decoding returns: each emitted token's entry from the
    verify row it was accepted or resampled under (the same filtered distribution a plain step
    samples from), and prompt logprobs from the prefill. Greedy: the same tokens, so the same
    entries; sampled: each entry is the processed log-softmax of the model's logits at that
    position, checked against a plain forward of the finished sequence."""
    import labkit  # noqa: F401 - registers the speculative executor factory

    sp = SamplingParams(temperature=temperature, top_k=20, max_tokens=12, logprobs=3,
                        prompt_logprobs=2, ignore_eos=True, seed=7)
    spec = LLM.from_model(tiny_model, None, block_size=4, speculative_config={
        "method": "draft_model", "model": tiny_model, "num_speculative_tokens": 3})
    got = spec.generate(prompt_token_ids=prompts[:2], sampling_params=sp)
    assert spec.llm_engine.executor.num_accepted_tokens > 0
    if temperature == 0:
        want = LLM.from_model(tiny_model, None, block_size=4).generate(
            prompt_token_ids=prompts[:2], sampling_params=sp)
        for g, w in zip(got, want):
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
            assert_entries_close(g.outputs[0].logprobs, w.outputs[0].logprobs)
            assert_entries_close(g.prompt_logprobs[1:], w.prompt_logprobs[1:])
    for g, p in zip(got, prompts[:2]):
        ids = list(p) + list(g.outputs[0].token_ids)
        with torch.no_grad():
            logits = tiny_model(torch.tensor([ids]))[0].float()
        for j, entry in enumerate(g.outputs[0].logprobs):
            row = processed_logprobs(logits[len(p) - 1 + j], temperature, 20, 1.0)
            t = g.outputs[0].token_ids[j]
            assert entry[t].logprob == pytest.approx(float(row[t]), abs=1e-4)


def assert_entries_close(a: list, b: list) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for t in x:
            assert x[t].rank == y[t].rank
            assert x[t].logprob == pytest.approx(y[t].logprob, abs=1e-4)


def test_step_outputs_carry_logprobs_for_streaming(tiny_model, prompts):
    """What a server streams: each StepOutput's logprobs match its new tokens, the prompt's
    come with the first output only, and a request that did not ask gets None."""
    from labkit.engine.llm_engine import LLMEngine

    eng = LLMEngine.from_model(tiny_model, None, block_size=4)
    eng.add_request("a", prompts[0], SamplingParams(temperature=0, max_tokens=4, logprobs=2,
                                                    prompt_logprobs=1, ignore_eos=True))
    eng.add_request("b", prompts[1], SamplingParams(temperature=0, max_tokens=4,
                                                    ignore_eos=True))
    seen: dict[str, list] = {"a": [], "b": []}
    while eng.has_unfinished_requests():
        for o in eng.step():
            seen[o.request_id].append(o)
    a, b = seen["a"], seen["b"]
    assert [len(o.logprobs) for o in a] == [len(o.new_token_ids) for o in a]
    assert a[0].prompt_logprobs is not None and len(a[0].prompt_logprobs) == len(prompts[0])
    assert all(o.prompt_logprobs is None for o in a[1:])
    assert all(o.logprobs is None and o.prompt_logprobs is None for o in b)


def test_a_batch_without_logprobs_pays_nothing(tiny_model, prompts, monkeypatch):
    """No logprob maths and no extra logits rows unless a request asks: the forward keeps one
    row per sampling chunk, and the log-softmax / top-k helpers are never called."""
    import labkit.engine.model_runner as mr

    def boom(*a, **k):
        raise AssertionError("logprobs computed for a request that did not ask")

    monkeypatch.setattr(mr, "processed_logprobs", boom)
    monkeypatch.setattr(mr, "token_entry", boom)
    monkeypatch.setattr(mr, "split_prompt_rows", boom)
    llm = LLM.from_model(tiny_model, None, block_size=4, enable_prefix_caching=True)
    runner = llm.llm_engine.executor.runner
    rows_seen: list[list[list[int]]] = []
    forward = runner.forward
    runner.forward = lambda chunks, rows, **kw: (rows_seen.append(rows), forward(chunks, rows,
                                                                                 **kw))[1]
    sp = SamplingParams(temperature=0.8, seed=1, max_tokens=4, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts[:4], sampling_params=sp)
    assert all(len(r) <= 1 for rows in rows_seen for r in rows)

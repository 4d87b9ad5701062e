"""labkit's engine with LoRA adapters equals transformers + peft, alone and in mixed batches.

Every adapter is made by peft on a tiny random checkpoint written by transformers (conftest.py)
and has a random lora_B, so an engine that dropped or mixed up adapters would produce other
tokens (each test also checks that the adapters really change the output)."""

from __future__ import annotations

import pytest
import torch

import labkit
from labkit import LoRARequest, SamplingParams
from labkit.lora.adapter import lora_scaling, read_adapter_config
from labkit.model.loader import load_model

from .conftest import peft_greedy, save_adapter

PROMPTS = [[5, 17, 42, 8, 3, 9, 11], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 60], [33, 21, 90]]
N = 10


def make_llm(base_dir, **kw):
    """The engine as vLLM's API builds it, on the checkpoint folder."""
    kw = {"block_size": 4, "enable_lora": True, "max_loras": 2, "max_lora_rank": 16, **kw}
    return labkit.LLM(model=str(base_dir), dtype=torch.float32, device="cpu", **kw)


def greedy(n=N):
    return SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)


def tokens(outs):
    return [o.outputs[0].token_ids for o in outs]


def test_each_adapter_equals_transformers_peft_llama(llama_dir, llama_adapters):
    llm = make_llm(llama_dir, max_loras=3)
    prompt = PROMPTS[0]
    seen = {tuple(peft_greedy(llama_dir, None, prompt, N))}
    for i, (name, path) in enumerate(llama_adapters.items(), start=1):
        want = peft_greedy(llama_dir, path, prompt, N)
        got = tokens(llm.generate(prompt_token_ids=[prompt], sampling_params=greedy(),
                                  lora_request=LoRARequest(name, i, str(path))))[0]
        assert got == want, name
        seen.add(tuple(want))
    assert len(seen) == 4  # base and the three adapters all differ: the test can fail
    base = tokens(llm.generate(prompt_token_ids=[prompt], sampling_params=greedy()))[0]
    assert base == peft_greedy(llama_dir, None, prompt, N)


def test_adapter_equals_transformers_peft_qwen2(qwen_dir, tmp_path):
    """Qwen2: q/k/v carry biases, which LoRA leaves to the base layer."""
    path = save_adapter(qwen_dir, tmp_path / "q", ["q_proj", "v_proj", "down_proj"], seed=7)
    llm = make_llm(qwen_dir)
    prompt = PROMPTS[1]
    want = peft_greedy(qwen_dir, path, prompt, N)
    assert want != peft_greedy(qwen_dir, None, prompt, N)
    got = tokens(llm.generate(prompt_token_ids=[prompt], sampling_params=greedy(),
                              lora_request=LoRARequest("q", 1, path)))[0]
    assert got == want


def test_rslora_scaling_matches_peft(llama_dir, tmp_path):
    """rsLoRA scales by alpha / sqrt(r) (here 16 / 4 = 4, where plain LoRA gives 16 / 16 = 1)."""
    rs = save_adapter(llama_dir, tmp_path / "rs", ["q_proj", "o_proj", "up_proj"], r=16,
                      alpha=16, seed=5, b_std=0.1, use_rslora=True)
    plain = save_adapter(llama_dir, tmp_path / "plain", ["q_proj", "o_proj", "up_proj"], r=16,
                         alpha=16, seed=5, b_std=0.1)
    llm = make_llm(llama_dir)
    assert lora_scaling(read_adapter_config(rs)) == pytest.approx(4.0)
    assert lora_scaling(read_adapter_config(plain)) == pytest.approx(1.0)
    prompt = PROMPTS[0]
    want_rs = peft_greedy(llama_dir, rs, prompt, N)
    assert want_rs != peft_greedy(llama_dir, plain, prompt, N)
    got = tokens(llm.generate(prompt_token_ids=[prompt, prompt], sampling_params=greedy(),
                              lora_request=[LoRARequest("rs", 1, rs),
                                            LoRARequest("plain", 2, plain)]))
    assert got == [want_rs, peft_greedy(llama_dir, plain, prompt, N)]


def test_mixed_batch_equals_each_request_alone(llama_dir, llama_adapters):
    """Base + three adapters, max_loras=2: some requests wait for a slot; each step mixes at
    most two adapters; every output equals the same request run alone."""
    reqs = [LoRARequest(n, i, str(p)) for i, (n, p) in enumerate(llama_adapters.items(), 1)]
    prompts = [PROMPTS[i % 3] for i in range(8)]
    loras = [None, reqs[0], reqs[1], reqs[2], reqs[0], None, reqs[2], reqs[1]]
    llm = make_llm(llama_dir, max_loras=2, max_cpu_loras=3)
    mgr = llm.llm_engine.executor.manager
    per_step: list[set] = []
    activate = mgr.activate

    def spy(ids):
        per_step.append(set(ids))
        activate(ids)

    mgr.activate = spy
    admission = llm.llm_engine.scheduler.admission
    refused = []
    can_run = admission.can_run

    def admission_spy(seq, running):
        ok = can_run(seq, running)
        if not ok:
            refused.append(seq.request_id)
        return ok

    admission.can_run = admission_spy
    mixed = tokens(llm.generate(prompt_token_ids=prompts, sampling_params=greedy(),
                                lora_request=loras))
    assert max(len(s) for s in per_step) == 2  # two adapters shared a step, never three
    assert refused and mgr.counts["slot_evictions"] >= 1  # a third adapter waited for a slot
    alone = [tokens(make_llm(llama_dir).generate(prompt_token_ids=[p], sampling_params=greedy(),
                                                 lora_request=r))[0]
             for p, r in zip(prompts, loras)]
    assert mixed == alone
    assert len({tuple(t) for t in alone[:4]}) == 4


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_with_adapters_keeps_outputs(llama_dir, llama_adapters, mode):
    """A pool too small for all sequences forces preemption: recomputed KV must go through the
    same adapter again; a swapped-out sequence comes back only while its adapter may run."""
    reqs = [LoRARequest(n, i, str(p)) for i, (n, p) in enumerate(llama_adapters.items(), 1)]
    prompts = [PROMPTS[i % 3] for i in range(4)]
    loras = [reqs[0], None, reqs[1], reqs[2]]
    llm = make_llm(llama_dir, num_blocks=12, preemption_mode=mode, num_cpu_blocks=32)
    got = tokens(llm.generate(prompt_token_ids=prompts, sampling_params=greedy(16),
                              lora_request=loras))
    assert llm.llm_engine.scheduler.num_preemptions > 0
    want = [peft_greedy(llama_dir, None if r is None else r.lora_path, p, 16)
            for p, r in zip(prompts, loras)]
    assert got == want


def test_streaming_steps_with_an_adapter(llama_dir, llama_adapters):
    """Step by step (what a stream sees): the new tokens add up to the peft reference."""
    path = llama_adapters["attn"]
    llm = make_llm(llama_dir)
    eng = llm.llm_engine
    eng.add_request("s", PROMPTS[0], greedy(), lora_request=LoRARequest("attn", 1, path))
    seen = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            seen.extend(o.new_token_ids)
    assert seen == peft_greedy(llama_dir, path, PROMPTS[0], N)


def test_speculative_decoding_with_adapters(llama_dir, llama_adapters):
    """The draft is the base model (a second copy of it): it knows no adapter, so base requests
    accept (nearly) every draft and adapter requests fewer; verification keeps every output
    equal to transformers + peft either way."""
    reqs = [LoRARequest(n, i, str(p)) for i, (n, p) in enumerate(llama_adapters.items(), 1)]
    spec = {"method": "draft_model", "model": load_model(llama_dir), "num_speculative_tokens": 3}
    llm = make_llm(llama_dir, speculative_config=spec)
    ex = llm.llm_engine.executor
    prompt = PROMPTS[1]

    def run(lora):
        d0, a0 = ex.num_draft_tokens, ex.num_accepted_tokens
        got = tokens(llm.generate(prompt_token_ids=[prompt], sampling_params=greedy(16),
                                  lora_request=lora))[0]
        assert got == peft_greedy(llama_dir, None if lora is None else lora.lora_path,
                                  prompt, 16)
        return (ex.num_accepted_tokens - a0) / (ex.num_draft_tokens - d0)

    base_rate = run(None)
    adapter_rates = [run(r) for r in reqs]
    assert base_rate > 0.9 and max(adapter_rates) < base_rate
    mixed = tokens(llm.generate(prompt_token_ids=[prompt] * 4, sampling_params=greedy(16),
                                lora_request=[None, *reqs]))
    assert mixed == [peft_greedy(llama_dir, None if r is None else r.lora_path, prompt, 16)
                     for r in [None, *reqs]]


def test_text_prompts_with_an_adapter(llama_dir, llama_adapters):
    """Text in, text out: the folder's tokenizer encodes the prompt and decodes the adapter's
    tokens (the same ids as the token-id path)."""
    path = llama_adapters["mlp"]
    llm = make_llm(llama_dir)
    prompt = PROMPTS[0]
    out = llm.generate(" ".join(f"w{i}" for i in prompt), greedy(),
                       lora_request=LoRARequest("mlp", 1, str(path)))[0]
    want = peft_greedy(llama_dir, path, prompt, N)
    assert out.outputs[0].token_ids == want
    assert out.outputs[0].text == " ".join(f"w{i}" for i in want)

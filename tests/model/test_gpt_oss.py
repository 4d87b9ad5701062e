"""gpt-oss (sinks + sliding/full layers + YaRN + clamped-SwiGLU MoE) against transformers.

The checkpoint is made by transformers itself (``GptOssConfig`` + ``save_pretrained``, seeded,
with biases, sinks and norms perturbed so loading them matters and a small ``swiglu_limit`` so
the clamps engage). Logits must equal transformers'; greedy generation through the paged engine
(window 8 < the 20-30 token prompts, chunked prefill, prefix caching) must equal transformers'
``generate`` token for token.
"""

from __future__ import annotations

import pytest
import torch
from transformers import GptOssConfig, GptOssForCausalLM

import labkit
from labkit.engine.invariants import assert_no_leaks
from labkit.engine.llm import LLM
from labkit.engine.sampling_params import SamplingParams
from labkit.errors import ArchitectureUnsupportedError, ConfigError, MoEUnsupportedError
from labkit.model.config import ModelConfig
from labkit.model.fuse import fuse_model
from labkit.model.generate import generate
from labkit.model.gpt_oss import clamped_swiglu
from labkit.parallel.plan import make_plan
from labkit.quant.model import quantize_model

YARN = {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 32, "rope_theta": 150000.0}
BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
            num_experts_per_tok=2, sliding_window=8, max_position_embeddings=128,
            initializer_range=0.2, swiglu_limit=0.6, rope_parameters=YARN, eos_token_id=None)
MAX_NEW = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(7)
    model = GptOssForCausalLM(GptOssConfig(**BASE)).eval()
    with torch.no_grad():
        for name, t in model.named_parameters():
            if "norm" in name or "bias" in name or "sinks" in name:
                t.add_(torch.randn_like(t) * 0.5)
    path = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(5)
    shared = torch.randint(2, 64, (17,), generator=g).tolist()
    return [shared + [3, 4, 5], torch.randint(2, 64, (26,), generator=g).tolist(),
            shared + torch.randint(2, 64, (11,), generator=g).tolist(),
            torch.randint(2, 64, (21,), generator=g).tolist()]


def hf_greedy(model, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW)
    return out[0, len(prompt):].tolist()


def test_logits_config_and_parameters_equal_transformers(checkpoint):
    path, ref = checkpoint
    model, _ = labkit.load_pretrained(path, skip_tokenizer_init=True)
    ids = torch.randint(0, 64, (2, 23), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = ref(ids).logits
        torch.testing.assert_close(model(ids), want, atol=1e-4, rtol=1e-4)
        for layer in model.model.layers:  # the clamps engage: without them it differs
            layer.mlp.limit = 1e9
        assert (model(ids) - want).abs().max() > 1e-3
        for layer in model.model.layers:  # so do the sinks
            layer.mlp.limit = BASE["swiglu_limit"]
            layer.self_attn.sinks.zero_()
        assert (model(ids) - want).abs().max() > 1e-3
    c = model.config
    assert [(s.attention, s.sliding_window, s.mlp) for s in c.layer_specs()] == [
        ("sliding", 8, "gpt_oss_moe"), ("full", None, "gpt_oss_moe")] * 2
    assert c.rope_scaling["rope_type"] == "yarn" and c.attention_sinks
    n_ref = sum(t.numel() for t in ref.parameters())
    assert c.num_parameters() == n_ref == sum(p.numel() for p in model.parameters())


def test_clamped_swiglu_hand_case():
    """Interleaved columns: (gate, up) = (2, -3), (-1, 0.5); limit 1, alpha 2."""
    gu = torch.tensor([[2.0, -3.0, -1.0, 0.5]])
    got = clamped_swiglu(gu, alpha=2.0, limit=1.0)
    g1, u1 = 1.0, -1.0  # gate clamped to 1 from above, up to -1
    g2, u2 = -1.0, 0.5  # the gate is not clamped from below
    want = torch.tensor([[(u1 + 1) * g1 * torch.sigmoid(torch.tensor(2 * g1)),
                          (u2 + 1) * g2 * torch.sigmoid(torch.tensor(2 * g2))]])
    torch.testing.assert_close(got, want)


def test_router_softmax_over_the_chosen_logits(checkpoint):
    path, _ = checkpoint
    model, _ = labkit.load_pretrained(path, skip_tokenizer_init=True)
    moe = model.model.layers[0].mlp
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        logits, w, ids = moe.route(x)
        hand = x @ moe.router.weight.T + moe.router.bias
    torch.testing.assert_close(logits, hand)
    top = hand.topk(2, dim=-1)
    assert ids.tolist() == top.indices.tolist()
    torch.testing.assert_close(w, torch.softmax(top.values, dim=-1))


def test_contiguous_reference_generate_equals_transformers(checkpoint, prompts):
    path, ref = checkpoint
    model, _ = labkit.load_pretrained(path, skip_tokenizer_init=True)
    for p in prompts[:2]:
        assert generate(model, p, MAX_NEW, ignore_eos=True) == hf_greedy(ref, p)


def test_engine_greedy_equals_transformers(checkpoint, prompts):
    path, ref = checkpoint
    llm = LLM(model=path, dtype=torch.float32, device="cpu", block_size=4,
              max_num_batched_tokens=16, num_blocks=96, enable_prefix_caching=True)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    eng = llm.llm_engine
    assert_no_leaks(eng)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(ref, p) for p in prompts]
    assert eng.stats()["prefix_hit_tokens"] > 0
    sched = [x for s in eng.trace.steps for x in s["scheduled"]]
    assert any(x["chunked"] for x in sched)
    assert any({x["phase"] for x in s["scheduled"]} == {"prefill", "decode"}
               for s in eng.trace.steps)
    loads = [st["expert_load"] for st in eng.trace.steps if "expert_load" in st]
    assert loads and all(len(st) == 4 and all(sum(row) % 2 == 0 for row in st) for st in loads)
    assert sum(sum(row) for row in loads[0]) == 4 * 2 * sum(  # layers x top-2 x tokens
        x["num_tokens"] for x in eng.trace.steps[0]["scheduled"])


def test_refusals(checkpoint):
    path, _ = checkpoint
    model, _ = labkit.load_pretrained(path, skip_tokenizer_init=True)
    with pytest.raises(MoEUnsupportedError, match="weight quantization"):
        quantize_model(model, "int8")
    for ep in (False, True):  # sinks are not in the shard plan, nor these experts in EP's
        with pytest.raises(ArchitectureUnsupportedError, match="tensor parallelism"):
            make_plan(model.config, 2, 0, expert_parallel=ep)
    with pytest.raises(ArchitectureUnsupportedError, match="fused layers"):
        fuse_model(model)
    with pytest.raises(ConfigError, match="GptOssForCausalLM"):
        model.config.to_hf_dict()
    d = {**GptOssConfig(**BASE).to_dict(), "architectures": ["GptOssForCausalLM"]}
    with pytest.raises(ConfigError, match="rope type"):
        ModelConfig.from_hf_dict({**d, "rope_parameters": {"rope_type": "llama3",
                                                           "factor": 2.0}})

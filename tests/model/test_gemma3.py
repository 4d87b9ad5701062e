"""Gemma 3 (text) against transformers, on a tiny random checkpoint.

Made by transformers itself (``Gemma3TextConfig`` + ``Gemma3ForCausalLM.save_pretrained``,
seeded, norms perturbed so Gemma's ``1 + weight`` matters, a ``query_pre_attn_scalar`` unlike
head_dim, linear rope scaling on global layers, final logit softcapping). Logits must equal
transformers'; greedy generation through the paged engine (window 8 < the 20-30 token prompts,
5 local : 1 global layers, chunked prefill, prefix caching) must equal ``generate``.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

import labkit
from labkit.engine.invariants import assert_no_leaks
from labkit.engine.llm import LLM
from labkit.engine.piecewise import cannot_compile
from labkit.engine.sampling_params import SamplingParams
from labkit.errors import ArchitectureUnsupportedError, ConfigError
from labkit.model.config import ModelConfig
from labkit.model.fuse import fuse_model
from labkit.model.gemma3 import GemmaRMSNorm
from labkit.model.generate import generate
from labkit.parallel.plan import make_plan
from labkit.quant.model import quantize_model

BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=6,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=8,
            max_position_embeddings=128, query_pre_attn_scalar=12, initializer_range=0.1,
            final_logit_softcapping=3.0, rope_scaling={"rope_type": "linear", "factor": 4.0},
            eos_token_id=None, bos_token_id=None, pad_token_id=None)
MAX_NEW = 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(11)
    model = Gemma3ForCausalLM(Gemma3TextConfig(**BASE)).eval()
    with torch.no_grad():
        for name, t in model.named_parameters():
            if "norm" in name:
                t.add_(torch.randn_like(t) * 0.3)
    path = tmp_path_factory.mktemp("gemma3")
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(2, 64, (17,), generator=g).tolist()
    return [shared + [3, 4, 5], torch.randint(2, 64, (27,), generator=g).tolist(),
            shared + torch.randint(2, 64, (9,), generator=g).tolist(),
            torch.randint(2, 64, (22,), generator=g).tolist()]


def hf_greedy(model, prompt: list[int]) -> list[int]:
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW)
    return out[0, len(prompt):].tolist()


def test_logits_config_and_parameters_equal_transformers(checkpoint):
    path, ref = checkpoint
    model, _ = labkit.load_pretrained(path, skip_tokenizer_init=True)
    ids = torch.randint(0, 64, (2, 25), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got, want = model(ids), ref(ids).logits
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    assert got.abs().max() < 3.0  # softcapped
    c = model.config
    assert [s.sliding_window for s in c.layer_specs()] == [8] * 5 + [None]
    g = c.gemma3
    assert (g.query_pre_attn_scalar, g.rope_local_base_freq, g.rope_scaling_factor,
            c.rope_theta) == (12.0, 10000.0, 4.0, 1e6)
    n_ref = sum(t.numel() for t in ref.parameters())
    assert c.num_parameters() == n_ref == sum(p.numel() for p in model.parameters())


def test_gemma_rmsnorm_hand_case():
    norm = GemmaRMSNorm(2, eps=0.0)
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([0.5, -1.0]))
    x = torch.tensor([[3.0, 4.0]])  # rms = sqrt(12.5)
    want = x / 12.5 ** 0.5 * torch.tensor([1.5, 0.0])
    torch.testing.assert_close(norm(x), want)


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


def test_refusals(checkpoint):
    path, _ = checkpoint
    model, _ = labkit.load_pretrained(path, skip_tokenizer_init=True)
    for call, match in [(lambda: quantize_model(model, "int8"), "weight quantization"),
                        (lambda: make_plan(model.config, 2, 0), "tensor parallelism"),
                        (lambda: fuse_model(model), "fused layers")]:
        with pytest.raises(ArchitectureUnsupportedError, match=match):
            call()
    with pytest.raises(ConfigError, match="Gemma3ForCausalLM"):
        model.config.to_hf_dict()
    assert "sandwich norms" in cannot_compile(model)  # compile=True runs it eager, says why
    d = {**Gemma3TextConfig(**BASE).to_dict(), "architectures": ["Gemma3ForCausalLM"]}
    for bad, match in [(dict(attn_logit_softcapping=50.0), "attn_logit_softcapping"),
                       (dict(hidden_activation="gelu"), "hidden_activation")]:
        with pytest.raises(ConfigError, match=match):
            ModelConfig.from_hf_dict({**d, **bad})

"""DeepSeek-V3 (MLA + DeepSeekMoE + YaRN) against transformers, on tiny random checkpoints.

Each checkpoint is made by transformers itself (``DeepseekV3Config`` + ``save_pretrained``,
seeded, norms and the router's selection bias perturbed so they matter), loaded by labkit from
the folder: logits must equal transformers' and greedy generation through the paged engine
(latent cache, absorbed decode, chunked prefill, prefix caching, preemption) must equal
transformers' ``generate`` token for token.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

import labkit
from labkit.engine.invariants import assert_no_leaks
from labkit.engine.llm import LLM
from labkit.engine.sampling_params import SamplingParams
from labkit.errors import ConfigError, MLAUnsupportedError
from labkit.kv.cache import model_kv_bytes_per_block
from labkit.model.config import ModelConfig
from labkit.model.deepseek_moe import grouped_topk
from labkit.model.fuse import fuse_projections
from labkit.model.generate import generate
from labkit.parallel.plan import make_plan
from labkit.quant.model import quantize_model

YARN = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0, "mscale": 1.0,
        "mscale_all_dim": 0.8, "original_max_position_embeddings": 32}
BASE = dict(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
            topk_group=1, first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=24,
            qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, max_position_embeddings=128,
            initializer_range=0.1, rms_norm_eps=1e-6, eos_token_id=None)
CASES = {  # name -> overrides of BASE
    "moe_yarn_qlora": dict(rope_parameters=YARN),
    "moe_plain_rope": dict(q_lora_rank=None, rope_interleave=False, n_shared_experts=2,
                           norm_topk_prob=False, routed_scaling_factor=1.5),
    "dense_only": dict(first_k_dense_replace=3, q_lora_rank=None, rope_parameters=YARN),
}
MAX_NEW = 8


def make_checkpoint(path, seed: int, **overrides) -> DeepseekV3ForCausalLM:
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**BASE, **overrides})).eval()
    with torch.no_grad():  # non-trivial norms and selection biases, so loading them matters
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name:
                t.add_(torch.randn_like(t) * 0.2)
            elif "e_score_correction_bias" in name:
                t.copy_(torch.randn_like(t) * 0.2)
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for i, (name, kw) in enumerate(CASES.items()):
        path = tmp_path_factory.mktemp(name)
        out[name] = (path, make_checkpoint(path, seed=10 + i, **kw))
    return out


@pytest.fixture(scope="module")
def prompts():
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(2, 64, (9,), generator=g).tolist()  # a prefix two prompts share
    return [shared + [5, 6, 7], torch.randint(2, 64, (13,), generator=g).tolist(),
            torch.randint(2, 64, (3,), generator=g).tolist(), shared + [9]]


def hf_greedy(model, prompt: list[int]) -> list[int]:
    """transformers' greedy ``generate``; the checkpoints have no EOS, so it runs the full
    length as labkit's ``ignore_eos`` does (``min_new_tokens`` would instead mask EOS's logit
    and pick the runner-up)."""
    out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=MAX_NEW)
    assert out.shape[1] == len(prompt) + MAX_NEW
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("name", list(CASES))
def test_logits_and_parameters_equal_transformers(checkpoints, name):
    path, ref = checkpoints[name]
    model, tok = labkit.load_pretrained(path, skip_tokenizer_init=True)
    ids = torch.randint(0, 64, (2, 21), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-4, rtol=1e-4)
    c = model.config
    assert {s.attention for s in c.layer_specs()} == {"mla"}
    assert [s.mlp for s in c.layer_specs()] == (
        ["dense"] * 3 if name == "dense_only" else ["dense", "deepseek_moe", "deepseek_moe"])
    hf_count = sum(t.numel() for n, t in [*ref.named_parameters(), *ref.named_buffers()]
                   if "rotary" not in n)
    assert c.num_parameters() == hf_count == sum(p.numel() for p in model.parameters())


def test_yarn_frequencies_and_scale_equal_transformers(checkpoints):
    _, ref = checkpoints["moe_yarn_qlora"]
    model, _ = labkit.load_pretrained(checkpoints["moe_yarn_qlora"][0],
                                      skip_tokenizer_init=True)
    from labkit.model.rope import yarn_parameters

    inv, factor = yarn_parameters(YARN, 8, 10000.0, 128)
    torch.testing.assert_close(inv, ref.model.rotary_emb.inv_freq, rtol=1e-6, atol=0)
    assert factor == pytest.approx(ref.model.rotary_emb.attention_scaling, rel=1e-9)
    attn = model.model.layers[0].self_attn
    assert attn.scale == pytest.approx(ref.model.layers[0].self_attn.scaling, rel=1e-9)
    m = 0.1 * 0.8 * math.log(4.0) + 1  # hand: mscale(4, mscale_all_dim=0.8)^2 / sqrt(20)
    assert attn.scale == pytest.approx(m * m / math.sqrt(20), rel=1e-9)


def test_grouped_topk_hand_case():
    """4 experts in 2 groups, one group kept: expert 3 has the best single score but its group
    (2, 3) loses on the sum of its top two, so the token gets experts 0 and 1; the bias picks
    but does not weigh."""
    logits = torch.tensor([[1.0, 0.5, -3.0, 2.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0])
    w, ids = grouped_topk(logits, 2, bias, n_group=2, topk_group=1, norm_topk_prob=False,
                          routed_scaling_factor=2.0)
    s = torch.sigmoid(logits[0])
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(w[0], 2.0 * s[:2])
    bias = torch.tensor([0.0, 0.0, 3.0, 0.0])  # now group (2, 3) wins, 2 ranks first
    w, ids = grouped_topk(logits, 2, bias, 2, 1, True, 1.0)
    assert ids.tolist() == [[2, 3]]
    torch.testing.assert_close(w[0], s[[2, 3]] / s[[2, 3]].sum())


def test_contiguous_reference_generate_equals_transformers(checkpoints, prompts):
    path, ref = checkpoints["moe_yarn_qlora"]
    model, _ = labkit.load_pretrained(path, skip_tokenizer_init=True)
    for p in prompts[:2]:
        assert generate(model, p, MAX_NEW, ignore_eos=True) == hf_greedy(ref, p)


def run_engine(path, prompts, **kw):
    llm = LLM(model=path, dtype=torch.float32, device="cpu", block_size=4, **kw)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert_no_leaks(llm.llm_engine)
    return [o.outputs[0].token_ids for o in outs], llm.llm_engine


@pytest.mark.parametrize("name", ["moe_yarn_qlora", "dense_only"])
def test_engine_greedy_equals_transformers(checkpoints, prompts, name):
    path, ref = checkpoints[name]
    got, eng = run_engine(path, prompts, max_num_batched_tokens=8, num_blocks=64)
    assert got == [hf_greedy(ref, p) for p in prompts]
    assert eng.stats()["prefix_hit_tokens"] > 0  # the shared prefix's latent blocks reused
    sched = [x for s in eng.trace.steps for x in s["scheduled"]]
    assert any(x["chunked"] for x in sched)  # a budget of 8 < the 13-token prompt: chunks
    # a step mixing a prefill chunk with decodes: expanded and absorbed paths in one forward
    assert any({x["phase"] for x in s["scheduled"]} == {"prefill", "decode"}
               for s in eng.trace.steps)
    kv, c = eng.executor.kv_cache, eng.executor.model.config
    width = c.mla.kv_lora_rank + c.mla.qk_rope_head_dim
    assert kv.k_caches[0].shape == (64, 4, 1, width) and kv.v_caches[0].numel() == 0
    per_block = 3 * 4 * width * 4  # layers x block x (latent + rope key) x fp32 bytes
    assert model_kv_bytes_per_block(c, 4, torch.float32) == per_block
    assert kv.nbytes() == 64 * per_block


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_engine_preemption_keeps_greedy(checkpoints, prompts, mode):
    path, ref = checkpoints["moe_plain_rope"]
    kw = dict(num_cpu_blocks=32) if mode == "swap" else {}
    got, eng = run_engine(path, prompts, num_blocks=12, preemption_mode=mode,
                          max_num_batched_tokens=32, **kw)
    assert got == [hf_greedy(ref, p) for p in prompts]
    assert {x["mode"] for s in eng.trace.steps for x in s["preempted"]} == {mode}


class ContiguousKVCacheOfKV:
    """A cache that only knows per-head K/V (``attend``), like the INT8 reference cache."""

    def attend(self, layer_idx, q, k, v, positions):
        raise AssertionError("an MLA layer must not hand a K/V cache expanded heads")


def test_refusals(checkpoints):
    """Features that address q/k/v_proj or cache per-head K/V refuse MLA by name; fusing skips
    the latent attention and still fuses the dense MLPs."""
    path, ref = checkpoints["dense_only"]
    with pytest.raises(ValueError, match="latent attention"):
        LLM(model=path, dtype=torch.float32, device="cpu", kv_cache_dtype="int8")
    model, _ = labkit.load_pretrained(path, skip_tokenizer_init=True)
    with pytest.raises(ConfigError, match="DeepSeek-V3"):
        model.config.to_hf_dict()
    with pytest.raises(MLAUnsupportedError, match="weight quantization"):
        quantize_model(model, "int8")
    with pytest.raises(MLAUnsupportedError, match="tensor parallelism"):
        make_plan(model.config, 2, 0)
    with pytest.raises(MLAUnsupportedError, match="without attend_latent"):
        model(torch.tensor([[1, 2]]), kv_cache=ContiguousKVCacheOfKV())
    assert fuse_projections(model) == 3  # the three dense MLPs' gate|up
    ids = torch.randint(0, 64, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids).logits, atol=1e-4, rtol=1e-4)
    d = {**DeepseekV3Config(**BASE).to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}
    for bad, match in [(dict(topk_group=3), "grouping"), (dict(num_experts_per_tok=5), "more"),
                       (dict(scoring_func="softmax"), "sigmoid"),
                       (dict(rope_parameters={"rope_type": "linear", "factor": 2.0}), "YaRN"),
                       (dict(qk_rope_head_dim=7), "even")]:
        with pytest.raises(ConfigError, match=match):
            ModelConfig.from_hf_dict({**d, **bad})


def test_speculative_decoding_keeps_greedy(checkpoints, prompts):
    """Verify passes (a chunk of gamma + 1 tokens, logits for every row) run the expanded path
    over the latent cache; a DeepSeek draft (here the model itself: every proposal accepted)
    runs on its own latent cache."""
    path, ref = checkpoints["dense_only"]
    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": 3}
    got, eng = run_engine(path, prompts[1:3], num_blocks=64, speculative_config=spec)
    assert got == [hf_greedy(ref, p) for p in prompts[1:3]]
    records = [r for s in eng.trace.steps for r in s.get("spec", [])]
    accepted = sum(r["accepted"] for r in records)
    assert accepted > 0 and accepted == sum(len(r["proposed"]) for r in records)

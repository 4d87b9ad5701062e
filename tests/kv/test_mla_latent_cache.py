"""The latent (MLA) paged cache: absorbed decode equals expanded attention on real latents, a
mixed step's split equals the contiguous reference, block copies / swaps move latents, and the
bytes the planner counts are DeepSeek-V3's 576 values per token and layer.

The latents are real: a DeepSeek-V3 attention layer (labkit's, seeded, weights wide enough that
attention is far from uniform) projects random hidden states; the blocks are shuffled and every
slot a sequence does not own holds garbage, so a gather or mask error shows.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config

from labkit.engine.invariants import assert_no_leaks
from labkit.engine.llm import LLM
from labkit.engine.sampling_params import SamplingParams
from labkit.kv.cache import (
    PagedKVCache,
    build_attention_metadata,
    kv_bytes_per_block,
    model_kv_bytes_per_block,
)
from labkit.kv.connector import OffloadingConnector
from labkit.kv.mla import (
    mla_decode_absorbed,
    mla_decode_expanded,
    mla_paged_attention,
    reshape_and_cache_latent,
)
from labkit.model.config import ModelConfig
from labkit.model.generate import generate
from labkit.model.layers import layer_kv_latent_dims
from labkit.model.llama import LlamaForCausalLM, rope_cos_sin

BS = 4
HF = dict(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
          num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=None,
          qk_rope_head_dim=8, qk_nope_head_dim=12, v_head_dim=10, first_k_dense_replace=1,
          n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2)


def hf_dict(**kw) -> dict:
    return {**DeepseekV3Config(**kw).to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}


@pytest.fixture(scope="module")
def mla():
    torch.manual_seed(0)
    model = LlamaForCausalLM(ModelConfig.from_hf_dict(hf_dict(**HF)))
    attn = model.model.layers[0].self_attn
    with torch.no_grad():
        for p in attn.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.3)
    return attn.eval()


def project(mla, n: int, seed: int):
    """n tokens' (q_nope, q_pe, kv_latent) at positions 0..n-1 from random hidden states."""
    x = torch.randn(1, n, 32, generator=torch.Generator().manual_seed(seed))
    cos, sin = rope_cos_sin(torch.arange(n)[None], 8, 10000.0, torch.float32)
    with torch.no_grad():
        q_nope, q_pe, kv = mla.project(x, cos, sin)
    return q_nope[0], q_pe[0], kv[0]


def paged(lens: list[int], kv: list[torch.Tensor], seed: int = 1):
    """A garbage-filled cache [num_blocks, BS, 1, 24] with each sequence's latents at shuffled
    blocks; returns (cache, block tables padded with block 0)."""
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // BS) for n in lens]
    perm = torch.randperm(sum(need) + 3, generator=g).tolist()
    cache = torch.randn(len(perm), BS, 1, 24, generator=g) * 5
    tables, i = [], 0
    for n, latents in zip(lens, kv):
        t = perm[i:i + -(-n // BS)]
        i += len(t)
        slots = torch.tensor([t[p // BS] * BS + p % BS for p in range(n)])
        reshape_and_cache_latent(latents[:n], cache, slots)
        tables.append(t)
    width = max(map(len, tables))
    return cache, torch.tensor([t + [0] * (width - len(t)) for t in tables])


def test_absorbed_decode_equals_expanded_on_real_latents(mla):
    lens = [9, 1, 6]
    seqs = [project(mla, n, seed=10 + i) for i, n in enumerate(lens)]
    cache, bt = paged(lens, [s[2] for s in seqs])
    q_nope = torch.stack([s[0][-1] for s in seqs])  # each sequence's last token queries
    q_pe = torch.stack([s[1][-1] for s in seqs])
    ctx = torch.tensor(lens)
    with torch.no_grad():
        absorbed = mla_decode_absorbed(q_nope, q_pe, cache, bt, ctx, mla.w_uk(), mla.w_uv(),
                                       mla.scale)
        expanded = mla_decode_expanded(q_nope, q_pe, cache, bt, ctx, mla)
        contiguous = torch.stack([mla.attend_expanded(s[0][None, -1:], s[1][None, -1:],
                                                      s[2][None])[0, 0] for s in seqs])
    torch.testing.assert_close(absorbed, expanded, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(absorbed, contiguous, rtol=1e-5, atol=1e-5)
    assert absorbed.shape == (3, 4, 10)
    # not a trivial average: the query picks its keys (the heads' outputs differ)
    assert (absorbed[0, 0] - absorbed[0, 1]).abs().max() > 1e-2


def test_mixed_step_equals_contiguous_reference(mla):
    """One packed step: a decode at position 8, a 4-token prefill chunk at positions 3..6 (its
    first 3 latents cached by an earlier chunk), a first token: each equals attention over the
    sequence's own latents."""
    lens, qlens = [9, 7, 1], [1, 4, 1]
    seqs = [project(mla, n, seed=20 + i) for i, n in enumerate(lens)]
    cache, bt = paged(lens, [s[2] for s in seqs], seed=2)
    meta = build_attention_metadata([0] * sum(qlens), bt.tolist(), qlens, lens, "cpu")
    q_nope = torch.cat([s[0][n - q:] for s, n, q in zip(seqs, lens, qlens)])
    q_pe = torch.cat([s[1][n - q:] for s, n, q in zip(seqs, lens, qlens)])
    with torch.no_grad():
        out = mla_paged_attention(q_nope, q_pe, cache, meta, mla)
        want = torch.cat([mla.attend_expanded(s[0][None, n - q:], s[1][None, n - q:],
                                              s[2][None])[0]
                          for s, n, q in zip(seqs, lens, qlens)])
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    assert "mla_plan" in meta.scratch  # built once per step, for every latent layer


def test_latent_blocks_copy_and_swap():
    kv = PagedKVCache(2, 6, BS, 4, 8, torch.float32, "cpu", num_cpu_blocks=3,
                      kv_latent_dims=[24, None])
    assert kv.k_caches[0].shape == (6, BS, 1, 24) and kv.v_caches[0].shape == (6, BS, 1, 0)
    assert kv.k_caches[1].shape == kv.v_caches[1].shape == (6, BS, 4, 8)
    assert kv.nbytes() == 6 * BS * (24 + 2 * 4 * 8) * 4
    block = torch.randn(BS, 1, 24, generator=torch.Generator().manual_seed(0))
    kv.k_caches[0][2] = block
    kv.copy_blocks([(2, 4)])
    kv.swap_out([(4, 1)])
    kv.swap_in([(1, 5)])
    assert torch.equal(kv.k_caches[0][5], block) and torch.equal(kv.cpu_k[0][1], block)
    with pytest.raises(ValueError, match="latent attention"):
        PagedKVCache(1, 4, BS, 1, 8, torch.float32, "cpu", kv_cache_dtype="int8",
                     kv_latent_dims=[24])


def test_deepseek_v3_bytes_per_token():
    """The real DeepSeek-V3 shapes (config only): 512 + 64 = 576 latent values per token and
    layer, against 2 x 128 heads x 128 = 32,768 for MHA's K and V."""
    c = ModelConfig.from_hf_dict(hf_dict())
    assert layer_kv_latent_dims(c) == [576] * 61
    bf16 = torch.bfloat16
    assert model_kv_bytes_per_block(c, 16, bf16) == 61 * 16 * 576 * 2
    mha = kv_bytes_per_block(61, 16, 128, 128, bf16)
    assert mha == 61 * 16 * 32768 * 2
    assert mha / model_kv_bytes_per_block(c, 16, bf16) == pytest.approx(56.89, abs=0.01)


def test_offloaded_latent_blocks_come_back_from_cpu():
    """The offloading connector stores and reloads latent blocks (its hooks wrap
    ``attend_latent``): with a device pool too small to keep a prefix, the second asking of each
    prompt loads its blocks from the CPU tier and greedy output equals the contiguous reference
    (itself equal to transformers, tests/model/test_deepseek_v3.py)."""
    torch.manual_seed(0)
    c = ModelConfig.from_hf_dict(hf_dict(**{**HF, "num_hidden_layers": 2}))
    model = LlamaForCausalLM(c).eval()
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(0, 32, (12,), generator=g).tolist() for _ in range(2)]
    prompts = [d + [i, i + 1] for i in (3, 7) for d in docs]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    conn = OffloadingConnector(cpu_bytes=1 << 20)
    llm = LLM.from_model(model, block_size=BS, num_blocks=6, max_num_seqs=1, kv_connector=conn)
    outs = [llm.generate(prompt_token_ids=[p], sampling_params=params, use_tqdm=False)[0]
            for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == [generate(model, p, 4, ignore_eos=True)
                                                      for p in prompts]
    s = conn.stats()
    # each document's 3 full blocks come back on its second asking: from the device pool's
    # leftovers or, evicted there, from the CPU tier
    assert s["device"]["hits"] + s["cpu"]["loads"] == 2 * 3 and s["cpu"]["loads"] >= 3
    assert s["cpu"]["bytes_loaded"] == s["cpu"]["loads"] * model_kv_bytes_per_block(
        c, BS, torch.float32)
    assert_no_leaks(llm.llm_engine)

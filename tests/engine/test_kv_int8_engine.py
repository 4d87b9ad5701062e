"""INT8 KV cache in the paged engine (``kv_cache_dtype="int8"``).

Reference: the model run one token at a time through labkit.quant's ``Int8ContiguousKVCache``
(per-(token, head) absmax scales, the same quantizer), so greedy engine output must equal it
token for token through chunked prefill, prefix caching, swap/recompute preemption and forks.
The block accounting is checked against sizes computed by hand.
"""

from __future__ import annotations

import os

import pytest
import torch

from labkit.engine.invariants import assert_no_leaks
from labkit.engine.llm import LLM
from labkit.engine.sampling_params import SamplingParams
from labkit.kv.cache import kv_bytes_per_block
from labkit.quant.kv_int8 import Int8ContiguousKVCache, quantize_kv_per_head

MAX_NEW = 10


@torch.inference_mode()
def int8_reference(model, prompt: list[int], max_new: int) -> list[int]:
    """Greedy decoding with the contiguous INT8 cache: prefill the prompt, then one token."""
    cache = Int8ContiguousKVCache(model, 1, len(prompt) + max_new)
    ids = list(prompt)
    pos = torch.arange(len(ids))[None]
    logits = model(torch.tensor([ids]), pos, cache)[0, -1]
    out = []
    for _ in range(max_new):
        tok = int(logits.argmax())
        out.append(tok)
        p = len(ids)
        ids.append(tok)
        logits = model(torch.tensor([[tok]]), torch.tensor([[p]]), cache)[0, -1]
    return out


@pytest.fixture(scope="module")
def int8_ref(tiny_model):
    memo: dict = {}

    def ref(prompt, max_new=MAX_NEW):
        key = (tuple(prompt), max_new)
        if key not in memo:
            memo[key] = int8_reference(tiny_model, prompt, max_new)
        return memo[key]

    return ref


def run_int8(model, prompts, params=None, **kw):
    llm = LLM.from_model(model, None, kv_cache_dtype="int8", **kw)
    params = params or SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    eng = llm.llm_engine
    assert_no_leaks(eng)  # everything released (free or cached), swap space empty
    return outs, eng


@pytest.mark.parametrize("block_size,budget", [(4, 24), (16, 256)])
def test_int8_engine_greedy_equals_int8_reference(tiny_model, prompts, int8_ref, block_size,
                                                  budget):
    outs, eng = run_int8(tiny_model, prompts, block_size=block_size, max_num_seqs=4,
                         max_num_batched_tokens=budget)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == int8_ref(p)
    kv = eng.executor.kv_cache
    assert kv.k_caches[0].dtype == torch.int8 and kv.k_scales[0].dtype == torch.float16
    assert eng.stats()["prefix_hit_tokens"] > 0  # shared prefixes reuse quantized blocks


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_int8_preemption_keeps_scales(tiny_model, prompts, int8_ref, mode):
    """Swapped-out blocks must carry their scales to the CPU pool and back."""
    outs, eng = run_int8(tiny_model, prompts, block_size=4, num_blocks=16, preemption_mode=mode,
                         num_cpu_blocks=32 if mode == "swap" else 0, max_num_batched_tokens=32)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == int8_ref(p)
    assert {x["mode"] for s in eng.trace.steps for x in s["preempted"]} == {mode}


def test_int8_fork_copy_on_write(tiny_model, prompts, int8_ref):
    """n=3 greedy samples share the prompt's blocks; the partial block is copied (CoW) with
    its scales when the samples diverge in writing."""
    sp = SamplingParams(n=3, temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs, eng = run_int8(tiny_model, prompts[:3], sp, block_size=4)
    for p, o in zip(prompts[:3], outs):
        assert [c.token_ids for c in o.outputs] == [int8_ref(p)] * 3
    assert any(e["type"] == "cow" for s in eng.trace.steps for e in s["events"])


@torch.inference_mode()
def test_stored_int8_values_are_per_token_head_quantized(tiny_model, prompts):
    """After a prefill the cache holds quantize_kv_per_head of each token's K at its slot."""
    llm = LLM.from_model(tiny_model, None, kv_cache_dtype="int8", block_size=4,
                         enable_prefix_caching=False)
    eng = llm.llm_engine
    p = prompts[4]  # 33 tokens: 9 blocks, the last one partial
    eng.add_request("a", p, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    eng.step()
    seq = eng.requests["a"].seqs[0]
    ref = Int8ContiguousKVCache(tiny_model, 1, len(p))
    tiny_model(torch.tensor([p]), torch.arange(len(p))[None], ref)
    kv = eng.executor.kv_cache
    slots = torch.tensor([seq.block_table[i // 4] * 4 + i % 4 for i in range(len(p))])
    H, D = kv.k_caches[0].shape[2:]
    for layer in range(tiny_model.config.num_hidden_layers):
        got_q = kv.k_caches[layer].view(-1, H, D)[slots]
        got_s = kv.v_scales[layer].view(-1, H)[slots]
        assert (got_q.int() - ref.k[layer][0].int()).abs().max() <= 1  # rounding ties only
        torch.testing.assert_close(got_s.float(), ref.v_scale[layer][0].float(), rtol=1e-3,
                                   atol=0)
        # and the engine's value is the quantizer applied to the dequantizable data it stored
        q2, _ = quantize_kv_per_head(got_q.float() * kv.k_scales[layer].view(-1, H)[slots]
                                     .float()[..., None])
        assert torch.equal(q2, got_q)


def test_blocks_from_bytes_hand_computed(tiny_model):
    # L=2, Hkv=2, D=16, block_size=4, fp32 model:
    #   auto: 2 (K,V) * 2 layers * 4 tokens * 2 heads * 16 dims * 4 bytes      = 2048 B/block
    #   int8: 2 * 2 * 4 * 2 * (16 int8 bytes + 2-byte fp16 scale)             =  576 B/block
    assert kv_bytes_per_block(2, 4, 2, 16, torch.float32) == 2048
    assert kv_bytes_per_block(2, 4, 2, 16, torch.float32, "int8") == 576
    budget = 20480
    auto = LLM.from_model(tiny_model, None, block_size=4, kv_cache_bytes=budget).llm_engine
    int8 = LLM.from_model(tiny_model, None, block_size=4, kv_cache_bytes=budget,
                          kv_cache_dtype="int8").llm_engine
    assert auto.stats()["num_blocks"] == 10  # 20480 // 2048
    assert int8.stats()["num_blocks"] == 35  # 20480 // 576
    s = int8.stats()
    assert s["kv_cache_dtype"] == "int8" and s["kv_bytes_per_block"] == 576
    assert s["kv_cache_bytes"] == 35 * 576 == int8.executor.kv_cache.nbytes()  # real tensors
    assert auto.stats()["kv_cache_bytes"] == auto.executor.kv_cache.nbytes() == 20480


@pytest.mark.parametrize("bad", ["fp8_e5m2", "INT8", "float16", None])
def test_bad_kv_cache_dtype(tiny_model, bad):
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM.from_model(tiny_model, None, kv_cache_dtype=bad)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        kv_bytes_per_block(2, 4, 2, 16, torch.float32, bad)


@pytest.mark.skipif(torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0")
                    in ("", "0"), reason="CPU tensors through Triton need TRITON_INTERPRET=1")
@pytest.mark.slow
def test_int8_with_triton_backend_equals_torch_backend(tiny_model, prompts):
    """The Triton kernels (interpreter on CPU) quantize in reshape_and_cache and dequantize in
    the attention tiles: the same greedy tokens as the torch backend's INT8 path, through
    chunked prefill (budget 16 < the 23- and 33-token prompts), prefix hits and decode, and as
    the contiguous INT8 reference wherever the torch backend equals it."""
    from labkit.kernels.backend import TritonBackend

    from labkit.bench.kv_int8_engine import int8_reference_greedy

    kw = dict(block_size=8, max_num_seqs=4, max_num_batched_tokens=16)
    torch_outs, _ = run_int8(tiny_model, prompts, attention_backend="torch", **kw)
    triton_outs, eng = run_int8(tiny_model, prompts, attention_backend="triton", **kw)
    kv = eng.executor.kv_cache
    assert isinstance(kv.backend, TritonBackend) and kv.k_caches[0].dtype == torch.int8
    assert any(x["chunked"] for s in eng.trace.steps for x in s["scheduled"])
    assert eng.stats()["prefix_hit_tokens"] > 0
    matched = 0
    for p, a, b in zip(prompts, torch_outs, triton_outs):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids, p
        if a.outputs[0].token_ids == int8_reference_greedy(tiny_model, p, MAX_NEW):
            matched += 1
    assert matched >= len(prompts) - 1  # INT8 near-ties may flip one prompt vs the reference


def test_int8_with_another_backend_is_a_clear_error():
    from types import SimpleNamespace

    from labkit.kv.cache import PagedKVCache

    with pytest.raises(ValueError, match=r"torch and triton attention backend\(s\) only"):
        PagedKVCache(2, 4, 4, 2, 16, torch.float32, "cpu", backend=SimpleNamespace(name="mine"),
                     kv_cache_dtype="int8")

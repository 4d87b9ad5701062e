"""The INT8 KV cache inside the paged engine: more blocks for the same bytes (part of
``labkit bench quant``).

Why: an INT8 cache stores each K/V element in one byte plus one fp16 scale per (token, head),
so a fixed KV byte budget holds ~2x more blocks than fp16 and ~3.8x more than fp32 (labkit-tiny,
head_dim 32). More blocks = more sequences running at once = bigger batches per step, which is
where serving throughput comes from. The benchmark gives the engine the same ``kv_cache_bytes``
twice (``kv_cache_dtype="auto"`` and ``"int8"``), runs the same greedy batch, and reports blocks,
peak concurrency, preemptions and tokens per CPU-second side by side; it also checks the INT8
engine's tokens against the reference (the model one token at a time over
``Int8ContiguousKVCache``) and counts how many outputs stay identical to the full-precision
engine's (and the fraction of tokens before the first divergence).
"""

from __future__ import annotations

from typing import Any

import torch


@torch.inference_mode()
def int8_reference_greedy(model: torch.nn.Module, prompt: list[int], max_new: int,
                          code_dtype: torch.dtype = torch.int8) -> list[int]:
    """Greedy tokens of the model over the contiguous per-(token, head) INT8 cache (or, with
    ``code_dtype=torch.float8_e4m3fn``, the FP8 one)."""
    from labkit.quant.kv_int8 import Int8ContiguousKVCache

    cache = Int8ContiguousKVCache(model, 1, len(prompt) + max_new, code_dtype)
    dev = model.device
    logits = model(torch.tensor([prompt], device=dev), torch.arange(len(prompt), device=dev)[None],
                   cache)[0, -1]
    out: list[int] = []
    for i in range(max_new):
        out.append(int(logits.argmax()))
        if i + 1 < max_new:
            p = len(prompt) + i
            logits = model(torch.tensor([[out[-1]]], device=dev),
                           torch.tensor([[p]], device=dev), cache)[0, -1]
    return out


def _run(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int, kv_bytes: int,
         kv_cache_dtype: str) -> tuple[dict[str, Any], list[list[int]]]:
    from labkit import LLM
    from labkit.bench.common import greedy_params, timed

    llm = LLM.from_model(model, None, kv_cache_bytes=kv_bytes, kv_cache_dtype=kv_cache_dtype,
                         max_num_seqs=len(prompts))
    outs, t = timed(llm.generate, prompt_token_ids=prompts,
                    sampling_params=greedy_params(max_tokens))
    cpu, wall = t.cpu_s, t.wall_s
    eng = llm.llm_engine
    s = eng.stats()
    tokens = [o.outputs[0].token_ids for o in outs]
    n = sum(map(len, tokens))
    return {"kv_cache_dtype": kv_cache_dtype, "kv_cache_bytes": s["kv_cache_bytes"],
            "kv_bytes_per_block": s["kv_bytes_per_block"], "num_blocks": s["num_blocks"],
            "peak_running": max(st["queues"]["running"] for st in eng.trace.steps),
            "mean_running": sum(st["queues"]["running"] for st in eng.trace.steps)
            / max(1, len(eng.trace.steps)),
            "num_preemptions": s["num_preemptions"], "num_steps": s["num_steps"],
            "tokens_per_cpu_s": n / cpu, "wall_tokens_per_s": n / wall}, tokens


def run_engine_int8_kv(model: torch.nn.Module, prompts: list[list[int]], max_tokens: int,
                       auto_blocks: int = 32, block_size: int = 16) -> dict[str, Any]:
    """Same byte budget (``auto_blocks`` blocks at the model's dtype), both KV dtypes."""
    from labkit.kv.cache import kv_bytes_per_block

    c = model.config
    kv_bytes = auto_blocks * kv_bytes_per_block(c.num_hidden_layers, block_size,
                                                c.num_key_value_heads, c.head_dim, model.dtype)
    auto, auto_tokens = _run(model, prompts, max_tokens, kv_bytes, "auto")
    int8, int8_tokens = _run(model, prompts, max_tokens, kv_bytes, "int8")
    ref = [int8_reference_greedy(model, p, max_tokens) for p in prompts]
    int8["matches_int8_reference"] = sum(a == b for a, b in zip(int8_tokens, ref))
    int8["identical_to_auto"] = sum(a == b for a, b in zip(int8_tokens, auto_tokens))
    # greedy paths diverge for good after the first differing token: count the shared prefix
    common = [next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), len(a))
              for a, b in zip(int8_tokens, auto_tokens)]
    int8["common_prefix_with_auto"] = sum(common) / max(1, sum(map(len, auto_tokens)))
    return {"num_prompts": len(prompts), "prompt_len": len(prompts[0]),
            "max_tokens": max_tokens, "block_size": block_size, "kv_cache_bytes": kv_bytes,
            "rows": [auto, int8],
            "block_ratio": int8["num_blocks"] / auto["num_blocks"],
            "throughput_ratio": int8["tokens_per_cpu_s"] / auto["tokens_per_cpu_s"]}

"""Decode speed of quantized models on CPU: packed kernels vs dequantize-then-matmul vs fp32.

Speeds are greedy tokens per **CPU-second** of this process (batch 1, the reference contiguous
cache, one torch thread unless ``--threads``), every model measured once per round, rounds
interleaved, best round kept: on a shared machine wall time mostly measures the other
processes, CPU time does not (memory stalls still count, so bandwidth effects show).

Why labkit-tiny barely moves: a decode step is ~100 small PyTorch ops (norms, RoPE, attention,
cache writes, 42 linears) whose fixed per-op cost (Python, dispatch, allocation: a few µs
each) dominates; ``matmul_share`` measures how much of a step the linears are, so 4x fewer
weight bytes can save at most that share. On a model with 100 M+ parameters each step reads
hundreds of MB of weights, more than caches hold, and decode is bound by memory traffic: there
INT8 / INT4 weights pay off roughly in proportion to the bytes they save (``--large``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from labkit.quant.linear import QuantLinear, use_cpu_packed

PACKED_FORMATS = ("int8", "int4_rtn", "gptq", "awq")
# hidden 1024, 10 layers, FFN 2816, 16/4 heads, vocab 4096: 116 M parameters, ~465 MB in fp32
LARGE = {"vocab_size": 4096, "hidden_size": 1024, "intermediate_size": 2816,
         "num_hidden_layers": 10, "num_attention_heads": 16, "num_key_value_heads": 4,
         "head_dim": 64, "max_position_embeddings": 512, "tie_word_embeddings": True}


def decode_cpu_tokens_per_s(model: nn.Module, prompt: list[int], new_tokens: int) -> float:
    """Greedy decode tokens per CPU-second (prefill excluded: timed from the first token)."""
    from labkit.model.generate import stream_generate

    it = stream_generate(model, prompt, new_tokens + 1, ignore_eos=True)
    next(it)  # prefill + first token
    c0 = time.process_time()
    n = sum(1 for _ in it)
    return n / max(time.process_time() - c0, 1e-9)


def compare_decode(models: dict[str, nn.Module], prompt: list[int], new_tokens: int,
                   rounds: int = 3) -> dict[str, dict[str, float]]:
    """Interleaved rounds over every model (and, for packed formats, its dequantize path);
    best round each: {name: {"tokens_per_s", "tokens_per_s_dequant"?}}."""
    runs: dict[tuple[str, bool], list[float]] = {}
    for m in models.values():  # warm-up: builds the packed weights, first-call allocations
        decode_cpu_tokens_per_s(m, prompt, 2)
    for _ in range(rounds):
        for name, m in models.items():
            runs.setdefault((name, True), []).append(
                decode_cpu_tokens_per_s(m, prompt, new_tokens))
            if name in PACKED_FORMATS:
                with use_cpu_packed(False):
                    runs.setdefault((name, False), []).append(
                        decode_cpu_tokens_per_s(m, prompt, new_tokens))
    out: dict[str, dict[str, float]] = {}
    for (name, packed), v in runs.items():
        out.setdefault(name, {})["tokens_per_s" if packed else "tokens_per_s_dequant"] = max(v)
    return out


def _cpu_us(fn: Callable[[], object], n: int = 50, rounds: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        c0 = time.process_time()
        for _ in range(n):
            fn()
        best = min(best, (time.process_time() - c0) / n)
    return best * 1e6


@torch.no_grad()
def matmul_share(model: nn.Module, tokens_per_s: float) -> dict[str, float]:
    """CPU µs of one batch-1 call of every linear (decoder + lm_head) in isolation, and the
    share of a measured decode step that is."""
    total = 0.0
    for m in model.modules():
        if isinstance(m, (nn.Linear, QuantLinear)):
            x = torch.randn(1, 1, m.in_features)
            total += _cpu_us(lambda m=m, x=x: m(x))
    step_us = 1e6 / tokens_per_s
    return {"linears_us_per_step": total, "step_us": step_us, "matmul_share": total / step_us}


def large_model(seed: int = 0) -> nn.Module:
    """A random-weight Llama of 116 M parameters (weights ~N(0, 0.02)): speed only."""
    from labkit.model.config import ModelConfig
    from labkit.model.llama import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(ModelConfig(**LARGE)).eval()


def run_large(quick: bool = False, rounds: int = 2) -> dict:
    """fp32 vs INT8 vs INT4 (RTN g128; GPTQ/AWQ share its kernel) decode on the 116 M model."""
    from labkit.quant import quantize_model
    from labkit.quant.evaluate import model_bytes

    model = large_model()
    models = {"fp32": model, "int8": quantize_model(model, "int8"),
              "int4_rtn": quantize_model(model, "int4_rtn", group_size=128)}
    prompt = list(range(1, 17))
    speeds = compare_decode(models, prompt, 8 if quick else 24, rounds)
    base = speeds["fp32"]["tokens_per_s"]
    rows = [{"format": n, "parameters": sum(p.numel() for p in model.parameters()),
             "weight_bytes": model_bytes(m), **speeds[n],
             "speedup_vs_fp32": speeds[n]["tokens_per_s"] / base}
            for n, m in models.items()]
    by = {r["format"]: r for r in rows}
    return {"config": LARGE, "rows": rows, "targets": {
        "large_int8_ge_1.5x_fp32": by["int8"]["speedup_vs_fp32"] >= 1.5,
        "large_int4_ge_1.5x_fp32": by["int4_rtn"]["speedup_vs_fp32"] >= 1.5}}

"""Accuracy and size of a (quantized) model: perplexity, KL vs full precision, bytes, speed.

Perplexity alone hides *where* a quantized model differs; the mean KL divergence of its
next-token distributions from the full-precision model's measures exactly the damage
quantization did, token by token, and is zero only for an identical model.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

CacheFactory = Callable[[nn.Module, int, int], object]


@torch.no_grad()
def log_probs(model: nn.Module, tokens: torch.Tensor, batch_size: int = 8,
              kv_cache_factory: CacheFactory | None = None) -> torch.Tensor:
    """log softmax of next-token logits, float32 [n, T, V] (optionally through a KV cache)."""
    outs = []
    for i in range(0, tokens.shape[0], batch_size):
        x = tokens[i:i + batch_size].to(model.device)
        cache = None if kv_cache_factory is None else kv_cache_factory(model, x.shape[0],
                                                                       x.shape[1])
        outs.append(F.log_softmax(model(x, kv_cache=cache).float(), dim=-1).cpu())
    return torch.cat(outs)


def perplexity_from_logprobs(lp: torch.Tensor, tokens: torch.Tensor) -> float:
    """exp(mean negative log-likelihood of token t+1 given tokens <= t)."""
    nll = -lp[:, :-1].gather(-1, tokens[:, 1:, None].to(lp.device)).squeeze(-1)
    return float(torch.exp(nll.double().mean()))


def mean_kl(ref_lp: torch.Tensor, lp: torch.Tensor) -> float:
    """Mean over positions of KL(p_ref || p) = Σ p_ref (log p_ref - log p)."""
    return float((ref_lp.exp() * (ref_lp - lp)).sum(-1).double().mean())


def model_bytes(model: nn.Module) -> int:
    """Bytes of every distinct parameter and buffer (tied tensors counted once)."""
    seen, total = set(), 0
    for t in list(model.parameters()) + list(model.buffers()):
        key = (t.data_ptr(), t.numel(), t.dtype)
        if key not in seen:
            seen.add(key)
            total += t.numel() * t.element_size()
    return total


@torch.no_grad()
def decode_tokens_per_s(model: nn.Module, prompt: list[int], new_tokens: int = 32,
                        repeats: int = 1) -> float:
    """Greedy decode speed with the reference contiguous cache (batch 1). Context only."""
    from labkit.model.generate import generate

    generate(model, prompt, 2, ignore_eos=True)  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        generate(model, prompt, new_tokens, ignore_eos=True)
        best = min(best, time.perf_counter() - t0)
    return new_tokens / best

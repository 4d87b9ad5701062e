"""Turning logits into the next token: greedy, temperature, top-k, top-p.

Everything that samples in labkit (the reference ``generate``, the engine, speculative decoding)
goes through these two functions, so seeded runs agree token for token. Filtering runs in float32
(bf16 logits would tie and round), and exactly one ``torch.multinomial`` draw is taken per sampled
token from the caller's generator: the random stream advances identically on every path.
"""

from __future__ import annotations

import math
import numbers

import torch


def validate_sampling(temperature: float, top_k: int, top_p: float) -> None:
    """Raise ValueError naming the bad knob; shared by generate, SamplingParams and the CLI."""
    for name, value in (("temperature", temperature), ("top_p", top_p), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(temperature) or not math.isfinite(top_p):
        raise ValueError(f"temperature and top_p must be finite, got {temperature}, {top_p}")
    if top_k != int(top_k):
        raise ValueError(f"top_k must be a whole number, got {top_k}")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < -1:
        raise ValueError(f"top_k must be -1 or 0 (off) or a positive count, got {top_k}")


def apply_sampling_filters(logits: torch.Tensor, temperature: float, top_k: int = 0,
                           top_p: float = 1.0) -> torch.Tensor:
    """The distribution ``sample_token`` draws from: probs [..., V] in float32.

    temperature 0 gives a one-hot on the argmax (the greedy limit), so speculative decoding can
    treat greedy and sampling alike. top_k <= 0 and top_p == 1 switch those filters off.
    """
    logits = logits.float()
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        # keep the smallest prefix whose mass reaches top_p (always at least one token)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_token(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, generator: torch.Generator | None = None) -> int:
    """One token id from logits [V]. Greedy (temperature 0) takes the first argmax."""
    if temperature == 0:
        return int(logits.argmax(-1))
    probs = apply_sampling_filters(logits, temperature, top_k, top_p)
    if probs.device.type != "cpu":
        probs = probs.cpu()  # one RNG stream per request, on the CPU, whatever the device
    return int(torch.multinomial(probs, 1, generator=generator))


def processed_logprobs(logits: torch.Tensor, temperature: float = 0.0, top_k: int = 0,
                       top_p: float = 1.0) -> torch.Tensor:
    """Log-probabilities [..., V] (float32) of the distribution ``sample_token`` draws from.

    vLLM's ``processed_logprobs``: ``log_softmax(logits / temperature)`` with the tokens top-k /
    top-p filtered out at -inf, so they agree with what was actually sampled. Greedy
    (temperature 0) has no distribution to speak of (a one-hot): it gets the raw
    ``log_softmax(logits)``, the model's own view, as vLLM returns for greedy requests.
    """
    logits = logits.float()
    if temperature == 0:
        return torch.log_softmax(logits, dim=-1)
    scaled = logits / temperature
    if (top_k <= 0 or top_k >= logits.shape[-1]) and top_p >= 1.0:
        return torch.log_softmax(scaled, dim=-1)
    kept = apply_sampling_filters(logits, temperature, top_k, top_p) > 0
    return torch.log_softmax(scaled.masked_fill(~kept, float("-inf")), dim=-1)

"""Reference generation with a contiguous KV cache: the ground truth for every engine path.

This is the simplest correct way to run a decoder: keep one [max_len] K and V tensor per layer,
prefill the whole prompt in one forward, then feed one token at a time. It wastes memory (the
cache is sized for the longest possible sequence up front: exactly what paged attention fixes)
but it is easy to trust, so the paged engine, speculative decoding and the Triton kernels are all
tested against it token for token.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator, Sequence

import torch

from labkit.model.layers import layer_kv_latent_dims, layer_sliding_windows
from labkit.model.llama import LlamaForCausalLM, causal_attention
from labkit.model.sampling import sample_token, validate_sampling


class ContiguousKVCache:
    """K/V as [B, max_len, Hkv, D] per layer; slot = position. Queries attend to keys <= them
    (and, in a sliding layer, to the last ``sliding_windows[layer]`` of those)."""

    def __init__(self, model: LlamaForCausalLM, batch_size: int, max_len: int) -> None:
        c = model.config
        shape = (batch_size, max_len, c.num_key_value_heads, c.head_dim)
        kw = {"dtype": model.dtype, "device": model.device}
        # a latent (MLA) layer keeps [B, max_len, latent_dim] in k and nothing in v
        latent = layer_kv_latent_dims(c)
        self.k = [torch.zeros(shape if w is None else (batch_size, max_len, w), **kw)
                  for w in latent]
        self.v = [torch.zeros(shape if w is None else (0,), **kw) for w in latent]
        self.max_len = max_len
        self.sliding_windows = layer_sliding_windows(c)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        start = int(positions[0, 0])
        end = start + q.shape[1]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, asked for {end}")
        self.k[layer_idx][:, start:end] = k
        self.v[layer_idx][:, start:end] = v
        return causal_attention(q, self.k[layer_idx][:, :end], self.v[layer_idx][:, :end],
                                self.sliding_windows[layer_idx], sinks=sinks)

    def attend_latent(self, layer_idx: int, q_nope: torch.Tensor, q_pe: torch.Tensor,
                      kv_latent: torch.Tensor, positions: torch.Tensor,
                      mla: torch.nn.Module) -> torch.Tensor:
        """A latent attention layer's hook (:mod:`labkit.model.mla`): store the latents, attend
        over every cached one by expanding them (the reference; the paged cache absorbs)."""
        start = int(positions[0, 0])
        end = start + q_nope.shape[1]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, asked for {end}")
        self.k[layer_idx][:, start:end] = kv_latent
        return mla.attend_expanded(q_nope, q_pe, self.k[layer_idx][:, :end])


def generate(model: LlamaForCausalLM, prompt_token_ids: Sequence[int], max_new_tokens: int,
             temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0,
             seed: int | None = None, stop_token_ids: Sequence[int] = (),
             ignore_eos: bool = False) -> list[int]:
    """Generate up to ``max_new_tokens`` after the prompt; returns only the new token ids.

    Stops after emitting an EOS token (unless ``ignore_eos``) or any of ``stop_token_ids``; the
    stopping token is included in the output, as vLLM's ``token_ids`` include EOS. Also stops
    when the model's context is full.
    """
    return list(stream_generate(model, prompt_token_ids, max_new_tokens, temperature, top_k,
                                top_p, seed, stop_token_ids, ignore_eos))


@torch.inference_mode()
def stream_generate(model: LlamaForCausalLM, prompt_token_ids: Sequence[int],
                    max_new_tokens: int, temperature: float = 0.0, top_k: int = 0,
                    top_p: float = 1.0, seed: int | None = None,
                    stop_token_ids: Sequence[int] = (), ignore_eos: bool = False
                    ) -> Iterator[int]:
    """``generate``, one token at a time (the CLI streams from this)."""
    prompt = list(prompt_token_ids)
    if not prompt:
        raise ValueError("prompt_token_ids is empty: give at least one token")
    try:  # ints, numpy ints and 0-d int tensors pass; floats, strings and bools do not
        if any(isinstance(t, bool) for t in prompt):
            raise TypeError
        prompt = [operator.index(t) for t in prompt]
    except TypeError:
        raise ValueError(f"prompt_token_ids must be integer token ids, got {prompt[:8]!r}; "
                         "encode text with the tokenizer first") from None
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    validate_sampling(temperature, top_k, top_p)
    cfg = model.config
    if max(prompt) >= cfg.vocab_size or min(prompt) < 0:
        raise ValueError(f"prompt token ids must be in [0, {cfg.vocab_size})")
    total = min(len(prompt) + max_new_tokens, cfg.max_position_embeddings)
    if len(prompt) >= total:
        raise ValueError(f"prompt of {len(prompt)} tokens leaves no room in the model's "
                         f"context of {cfg.max_position_embeddings} tokens")
    stops = set(stop_token_ids) | (set() if ignore_eos else set(cfg.eos_token_ids))
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    cache = ContiguousKVCache(model, 1, total)
    dev = model.device

    ids = torch.tensor([prompt], device=dev)
    pos = torch.arange(len(prompt), device=dev)[None]
    out: list[int] = []
    while True:
        logits = model(ids, pos, cache)[0, -1]
        tok = sample_token(logits, temperature, top_k, top_p, gen)
        out.append(tok)
        yield tok
        n = len(prompt) + len(out)
        if tok in stops or len(out) >= max_new_tokens or n >= total:
            return
        ids = torch.tensor([[tok]], device=dev)
        pos = torch.tensor([[n - 1]], device=dev)

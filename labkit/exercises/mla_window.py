"""Exercise: multi-head latent attention's decode with absorbed weights, and a sliding window's
block-freeing rule, checked on a real DeepSeek-V3-layout layer.

Three functions, each small and each easy to get subtly wrong:

* ``cache_entry(c, k_pe, positions, rope)``: what a latent layer stores per token: the
  normalised latent ``c`` [T, C] as it is, then the decoupled key ``k_pe`` [T, dr] rotated by
  ``rope(x, positions)``: [T, C + dr]. RoPE must not touch ``c``: the latent is position-free,
  which is what lets ``W_UK`` be folded into the query (a rotated latent would need a different
  ``W_UK`` per position).
* ``absorbed_decode(q_nope, q_pe, cache, w_uk, w_uv, scale)``: one decode query (q_nope [H, dn],
  q_pe [H, dr], already rotated) over a sequence's cached rows [S, C + dr], with
  ``w_uk`` [H, dn, C] and ``w_uv`` [H, dv, C]; returns [H, dv]. Fold ``W_UK`` into the query
  (``q_lat = W_UK^T q_nope``, [H, C]), score ``q_lat . c_s + q_pe . k_pe_s``, softmax, weight the
  *latents*, and apply ``W_UV`` once to the result: never expand a K or V per head.
* ``freeable_blocks(num_computed_tokens, window, block_size)``: with sliding-window attention of
  width ``window`` (a query at position q sees keys q - window + 1 .. q), how many of a
  sequence's leading blocks no future query reads, once ``num_computed_tokens`` tokens are in
  the cache (the next query is at position ``num_computed_tokens``).

The checker builds an :class:`~labkit.model.mla.MLAttention` layer (seeded random weights,
DeepSeek-V3's layout at toy width), projects real hidden states to latents with it, and compares
your decode with the layer's *expanded* attention (every latent expanded to per-head K and V,
the way prefill does it). A wrong answer that matches a known mistake is named: RoPE on the
latent, ``W_UV`` absorbed on the query side, the RoPE score term dropped, the scale forgotten, a
block freed while it still holds the window's first token, a window off by one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from labkit.exercises.checks import CheckFailure, call, run_check
from labkit.exercises.inject import inject as _inject

# DeepSeek-V3's layout at toy width (its real sizes: H 128, C 512, dn 128, dr 64, dv 128). dn ==
# dv, so absorbing W_UV where W_UK belongs is a shape-correct mistake the checker can name.
DIMS = {"hidden": 48, "heads": 4, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 6, "v_head_dim": 8, "tokens": 11}


def inject(name: str, learner: Callable) -> Callable:
    """The reference under ``LABKIT_INJECT_SOLUTIONS=1`` (CI), else the learner's own."""
    return _inject(name, learner, "mla_window_solutions")


def layer(seed: int = 0):
    """A seeded MLA layer and real inputs: (layer, x [1, T, hidden], cos, sin, positions)."""
    from labkit.model.config import ModelConfig
    from labkit.model.llama import rope_cos_sin
    from labkit.model.mla import MLAttention

    d = DIMS
    cfg = ModelConfig.from_hf_dict({
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": 64, "hidden_size": d["hidden"], "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": d["heads"],
        "num_key_value_heads": d["heads"], "kv_lora_rank": d["kv_lora_rank"],
        "q_lora_rank": None, "qk_nope_head_dim": d["qk_nope_head_dim"],
        "qk_rope_head_dim": d["qk_rope_head_dim"], "v_head_dim": d["v_head_dim"],
        "first_k_dense_replace": 1, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_group": 1, "topk_group": 1,
        "moe_intermediate_size": 16, "max_position_embeddings": 64, "rms_norm_eps": 1e-6,
        "rope_interleave": False, "rope_theta": 10000.0})
    torch.manual_seed(seed)
    mla = MLAttention(cfg, 0).eval()
    positions = torch.arange(d["tokens"])[None]
    x = torch.randn(1, d["tokens"], d["hidden"])
    cos, sin = rope_cos_sin(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
    return mla, x, cos, sin, positions


def _rope_fn() -> Callable:
    """``rope(x, positions)`` for the learner: rotate-half RoPE of any even width at positions
    (widths other than dr get their own frequencies, so a rotated latent is a real mistake)."""
    from labkit.model.llama import apply_rope, rope_cos_sin

    def rope(x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = rope_cos_sin(positions[None], x.shape[-1], 10000.0, x.dtype)
        return apply_rope(x[None, :, None], cos, sin)[0, :, 0]
    return rope


def _entries(mla, x):
    """The layer's own (c, unrotated k_pe) per token, before the cache."""
    c, k_pe = mla.kv_a_proj_with_mqa(x[0]).split([mla.kv_lora_rank, mla.qk_rope_head_dim], -1)
    return mla.kv_a_layernorm(c), k_pe


def _check_cache_entry(cache_entry: Callable, mla, x, cos, sin, positions) -> torch.Tensor:
    c, k_pe = _entries(mla, x)
    rope = _rope_fn()
    want = mla.project(x, cos, sin)[2][0]  # what the layer itself writes into the cache
    got = call(cache_entry, c, k_pe, positions[0], rope)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape:
        raise CheckFailure("cache_entry returned the wrong shape", expected=tuple(want.shape),
                           actual=getattr(got, "shape", got),
                           hint="one row per token: the latent (C values), then k_pe (dr)")
    if torch.allclose(got, want, atol=1e-5):
        return got
    rotated_all = rope(torch.cat([c, k_pe], -1), positions[0])
    if torch.allclose(got, rotated_all, atol=1e-5) or torch.allclose(
            got[:, :mla.kv_lora_rank], rope(c, positions[0]), atol=1e-5):
        raise CheckFailure("you applied RoPE to the latent", hint="only the decoupled k_pe is "
                           "rotated; the latent c must stay position-free, otherwise W_UK could "
                           "not be folded into the query (it would depend on each key's position)")
    if torch.allclose(got, torch.cat([c, k_pe], -1), atol=1e-5):
        raise CheckFailure("k_pe is cached unrotated", hint="rotate k_pe by its position once, "
                           "when it is cached: decode then never rotates past keys again")
    raise CheckFailure("cache_entry differs from what the layer caches",
                       expected=want[:2], actual=got[:2])


def _variants(q_nope, q_pe, cache, w_uk, w_uv, scale, C) -> dict[str, torch.Tensor]:
    """Known mistakes, computed so a wrong answer can be named."""
    from labkit.exercises.mla_window_solutions import absorbed_decode as ref

    rope_free = cache.clone()
    rope_free[:, C:] = 0
    return {"W_UV absorbed on the query side (and W_UK applied to the output)":
            ref(q_nope, q_pe, cache, w_uv, w_uk, scale),
            "the RoPE term q_pe . k_pe is missing from the scores":
            ref(q_nope, torch.zeros_like(q_pe), rope_free, w_uk, w_uv, scale),
            "the softmax scale is missing": ref(q_nope, q_pe, cache, w_uk, w_uv, 1.0)}


def _check_decode(absorbed_decode: Callable, mla, x, cos, sin) -> None:
    q_nope, q_pe, lat = mla.project(x, cos, sin)
    want = mla.attend_expanded(q_nope[:, -1:], q_pe[:, -1:], lat)[0, 0]  # the expanded form
    args = (q_nope[0, -1], q_pe[0, -1], lat[0], mla.w_uk().detach(), mla.w_uv().detach(),
            mla.scale)
    with torch.no_grad():
        got = call(absorbed_decode, *args)
        if isinstance(got, torch.Tensor) and got.shape == want.shape and \
                torch.allclose(got, want, rtol=1e-4, atol=1e-5):
            return
        for mistake, out in _variants(*args, mla.kv_lora_rank).items():
            if isinstance(got, torch.Tensor) and got.shape == out.shape and \
                    torch.allclose(got, out, rtol=1e-4, atol=1e-5):
                raise CheckFailure(f"absorbed_decode: {mistake}", hint="score_s = (W_UK^T "
                                   "q_nope) . c_s + q_pe . k_pe_s, times scale; softmax; "
                                   "out = W_UV (sum_s p_s c_s)")
    raise CheckFailure("absorbed_decode differs from the expanded attention on real latents",
                       expected=want[0, :4], actual=got[0, :4] if isinstance(
                           got, torch.Tensor) and got.dim() == 2 else got,
                       hint="the expanded form expands every latent to K = W_UK c (+ k_pe) and "
                       "V = W_UV c per head; yours must equal it without expanding")


def _check_freeing(freeable_blocks: Callable) -> None:
    from labkit.exercises.mla_window_solutions import freeable_blocks as ref

    for bs in (1, 4, 16):
        for w in (1, 4, 8, 17):
            for n in range(0, 48):
                want, got = ref(n, w, bs), call(freeable_blocks, n, w, bs)
                if got == want:
                    continue
                first = n - w + 1
                where = (f"{n} tokens cached, window {w}, block_size {bs}: the next query (at "
                         f"position {n}) reads keys {max(first, 0)}..{n}")
                if isinstance(got, int) and got > want:
                    raise CheckFailure("freed a block that still holds the window's first token",
                                       inputs=where, expected=want, actual=got,
                                       hint=f"block {want} holds position {max(first, 0)}, "
                                       "which the next query still reads")
                raise CheckFailure("the window is off by one" if got == want - 1 else
                                   "freed too few blocks", inputs=where, expected=want,
                                   actual=got, hint="a query at position q sees the window "
                                   "keys q - window + 1 .. q (itself included); a block is free "
                                   "once its last token is before the next query's first key")


def check(cache_entry: Callable, absorbed_decode: Callable,
          freeable_blocks: Callable) -> object:
    """The three functions against a real MLA layer and the sliding-window mask (module doc)."""

    def body() -> str:
        mla, x, cos, sin, positions = layer()
        with torch.no_grad():
            _check_cache_entry(cache_entry, mla, x, cos, sin, positions)
        _check_decode(absorbed_decode, mla, x, cos, sin)
        _check_freeing(freeable_blocks)
        d = DIMS
        per_token = d["kv_lora_rank"] + d["qk_rope_head_dim"]
        mha = d["heads"] * (d["qk_nope_head_dim"] + d["qk_rope_head_dim"] + d["v_head_dim"])
        return (f"your cache rows equal the layer's, your absorbed decode equals the expanded "
                f"attention on {d['tokens']} real latents, and your freeing rule matches the "
                f"window's mask in every case; this layer caches {per_token} values per token "
                f"against {mha} for per-head K and V (DeepSeek-V3: 576 against 40,960)")

    return run_check("mla_window", body)

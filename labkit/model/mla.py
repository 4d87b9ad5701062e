"""Multi-head latent attention (MLA, DeepSeek-V2/V3): cache one small latent per token, not K and V.

**Why.** Multi-head attention caches a K and a V vector per head: DeepSeek-V3's 128 heads of 128
values would be 2 x 128 x 128 = 32,768 values per token and layer. MLA projects each token down
to a latent ``c_KV`` of ``kv_lora_rank`` = 512 values (``kv_a_proj_with_mqa``, then
``kv_a_layernorm``) from which *every* head's K and V are linear functions (``kv_b_proj`` =
``[W_UK; W_UV]`` per head), plus one ``qk_rope_head_dim`` = 64 rotary key ``k_pe`` shared by all
heads (position must stay outside the latent: a rotation depends on the position and would not
commute with the up-projection). So the cache holds 512 + 64 = **576 values per token and
layer, 57x fewer** than the 32,768 of MHA; per token and head, q.k = q_nope.k_nope + q_pe.k_pe::

    q   = q_b_proj(RMSNorm(q_a_proj(x)))  (or q_proj(x))  -> per head [q_nope | q_pe]
    c   = RMSNorm(kv_a_proj_with_mqa(x)[:kv_lora_rank]),  k_pe = rope(the rest)  -> CACHED
    k_h = [W_UK_h c | k_pe],   v_h = W_UV_h c,   out = o_proj(concat_h softmax(q_h.k_h s) v_h)

**Two ways to attend, same numbers.** ``q_nope . (W_UK c) = (W_UK^T q_nope) . c`` and
``sum_j p_j (W_UV c_j) = W_UV (sum_j p_j c_j)``:

- *prefill expands* (:meth:`MLAttention.attend_expanded`): T queries against S keys. Expanding
  the S latents to per-head K and V costs S x kv_lora_rank x H(dn + dv) once, after which
  attention runs at the small head widths (dn + dr = 192 for q.k); compute-bound, so fewer FLOPs
  win.
- *decode absorbs* (:func:`labkit.kv.mla.mla_decode_absorbed`): one query against S cached
  latents. Absorbing ``W_UK`` into the query (one [dn x 512] matmul per head) lets the scores
  read the latents in place, and ``W_UV`` is applied once to the attention-weighted latent; the
  per-head K/V are never materialised, so decode reads 576 values per cached token instead of
  the 32,768 an expanded cache would hold. Memory-bound, so fewer bytes win.

The softmax scale is ``(dn + dr)^-0.5``, times YaRN's ``mscale(factor, mscale_all_dim)^2``
(:func:`labkit.model.rope.yarn_softmax_scale`). Parameter names are transformers'
``DeepseekV3Attention``'s, so a checkpoint loads 1:1.

**The cache seam.** Without a cache the layer attends over the tokens it was given (expanded).
With one it hands the cache its new latents (``[latent | k_pe]``, one "head" of width
``latent_dim``) and calls ``kv_cache.attend_latent(layer_idx, q_nope, q_pe, kv_latent, positions,
self)``: the cache stores them at their slots and runs the expanded path for prefill chunks and
the absorbed path for single-token decodes, reading ``w_uk`` / ``w_uv`` / ``scale`` /
``expand_kv`` from the layer (the paged :class:`labkit.kv.cache.PagedKVCache`, and the reference
``ContiguousKVCache`` of :mod:`labkit.model.generate`).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from labkit.errors import MLAUnsupportedError
from labkit.model.config import ModelConfig
from labkit.model.layers import register_attention
from labkit.model.llama import RMSNorm, apply_rope, causal_attention
from labkit.model.rope import apply_rope_interleaved, yarn_softmax_scale

LATENT_NORM_EPS = 1e-6  # transformers' q_a_layernorm / kv_a_layernorm ignore rms_norm_eps


class LatentKVCache(Protocol):
    def attend_latent(self, layer_idx: int, q_nope: torch.Tensor, q_pe: torch.Tensor,
                      kv_latent: torch.Tensor, positions: torch.Tensor,
                      mla: MLAttention) -> torch.Tensor:
        """Store kv_latent [B,T,latent_dim]; return attention output [B,T,H,v_head_dim]."""
        ...


@register_attention("mla")
class MLAttention(nn.Module):
    """DeepSeek-V3's attention; see the module docstring for the cache it needs."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        m, h, b = config.mla, config.hidden_size, config.attention_bias
        self.layer_idx = layer_idx
        self.num_heads = H = config.num_attention_heads
        self.kv_lora_rank, self.qk_nope_head_dim = m.kv_lora_rank, m.qk_nope_head_dim
        self.qk_rope_head_dim, self.v_head_dim = m.qk_rope_head_dim, m.v_head_dim
        self.rope_interleave = m.rope_interleave
        self.q_lora_rank = m.q_lora_rank
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(h, H * m.qk_head_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, m.q_lora_rank, bias=b)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, H * m.qk_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, m.latent_dim, bias=b)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(m.kv_lora_rank, H * (m.qk_nope_head_dim + m.v_head_dim),
                                   bias=False)
        self.o_proj = nn.Linear(H * m.v_head_dim, h, bias=b)
        self.scale = m.qk_head_dim ** -0.5 * yarn_softmax_scale(config.rope_scaling)

    # ---- the up-projections, as the two paths need them ----------------------------------
    def _kv_b(self) -> torch.Tensor:
        """``kv_b_proj.weight`` per head: [H, dn + dv, kv_lora_rank] (a view)."""
        return self.kv_b_proj.weight.view(self.num_heads, -1, self.kv_lora_rank)

    def w_uk(self) -> torch.Tensor:
        """W_UK [H, qk_nope_head_dim, kv_lora_rank]: latent -> each head's position-free key."""
        return self._kv_b()[:, :self.qk_nope_head_dim]

    def w_uv(self) -> torch.Tensor:
        """W_UV [H, v_head_dim, kv_lora_rank]: latent -> each head's value."""
        return self._kv_b()[:, self.qk_nope_head_dim:]

    def expand_kv(self, kv_latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cached latents [..., S, latent_dim] -> K [..., S, H, dn + dr], V [..., S, H, dv]."""
        c, k_pe = kv_latent.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(c).unflatten(-1, (self.num_heads, -1))
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        k_pe = k_pe.unsqueeze(-2).expand(*k_nope.shape[:-1], self.qk_rope_head_dim)
        return torch.cat([k_nope, k_pe], dim=-1), v

    def attend_expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor,
                        kv_latent: torch.Tensor) -> torch.Tensor:
        """Prefill: q [B,T,H,*] (the last T positions) over S >= T latents [B,S,latent_dim],
        causal, by expanding every latent to per-head K and V. Returns [B,T,H,dv]."""
        k, v = self.expand_kv(kv_latent)
        q = torch.cat([q_nope, q_pe], dim=-1)
        return causal_attention(q, k, v, scale=self.scale)

    # ---- the layer ---------------------------------------------------------------------------
    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rope_interleave:
            return apply_rope_interleaved(x, cos, sin)
        return apply_rope(x, cos, sin)

    def project(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B,T,hidden] -> q_nope [B,T,H,dn], rotated q_pe [B,T,H,dr] and the tokens' cache
        entries kv_latent [B,T,kv_lora_rank + dr] (normalised latent | rotated shared key)."""
        B, T, _ = x.shape
        q = (self.q_proj(x) if self.q_lora_rank is None
             else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))))
        q_nope, q_pe = q.view(B, T, self.num_heads, -1).split(
            [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim],
                                                   dim=-1)
        k_pe = self._rope(k_pe[:, :, None], cos, sin)[:, :, 0]
        kv_latent = torch.cat([self.kv_a_layernorm(c), k_pe], dim=-1)
        return q_nope, self._rope(q_pe, cos, sin), kv_latent

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor, kv_cache: LatentKVCache | None) -> torch.Tensor:
        B, T, _ = x.shape
        q_nope, q_pe, kv_latent = self.project(x, cos, sin)
        if kv_cache is None:
            out = self.attend_expanded(q_nope, q_pe, kv_latent)
        elif not hasattr(kv_cache, "attend_latent"):  # a cache of per-head K/V only
            raise MLAUnsupportedError(f"{type(kv_cache).__name__} (a KV cache without "
                                      "attend_latent)", "DeepseekV3ForCausalLM")
        else:
            out = kv_cache.attend_latent(self.layer_idx, q_nope, q_pe, kv_latent, positions,
                                         self)
        return self.o_proj(out.reshape(B, T, self.num_heads * self.v_head_dim))


def refuse_mla(config: object, feature: str) -> None:
    """Raise :class:`~labkit.errors.MLAUnsupportedError` if ``config`` has latent attention: the
    guard of the features that address attention weights by the dense names (every caller of
    :func:`labkit.model.moe.refuse_moe` gets it too, and tensor parallelism)."""
    if getattr(config, "mla", None) is not None:
        raise MLAUnsupportedError(feature, config.architecture)

"""Rotary embeddings beyond the default: YaRN's frequencies and DeepSeek's interleaved pairs.

**YaRN** (``rope_scaling = {"rope_type": "yarn", "factor": s, ...}``) stretches a model trained
on ``original_max_position_embeddings`` positions to ``s`` times as many. Each rotary pair i
turns at ``theta^(-2i/d)``; pairs that complete many turns within the original context (high
frequency, below the ``beta_fast`` boundary) already generalise and keep their frequency, pairs
that turn less than ``beta_slow`` times are *interpolated* (frequency / s), and a linear ramp
blends the pairs in between. Two temperature corrections follow, as transformers applies them:

- ``attention_factor`` multiplies cos and sin (so every rotated q.k grows by its square);
  default ``mscale(s, mscale) / mscale(s, mscale_all_dim)``, where
  ``mscale(s, m) = 0.1 * m * ln(s) + 1`` (1 when s <= 1);
- DeepSeek's attention multiplies the *softmax scale* by ``mscale(s, mscale_all_dim)^2``
  (:func:`yarn_softmax_scale`). DeepSeek-V3 sets mscale = mscale_all_dim = 1 with s = 40: the
  rotated part is untouched and every logit is scaled by (0.1 ln 40 + 1)^2 = 1.87.

**Interleaved pairs** (DeepSeek's ``rope_interleave``): the pairs are ``(x0, x1), (x2, x3),
...`` instead of Llama's ``(x_i, x_{i+d/2})``. transformers rotates the even and odd slices and
writes them de-interleaved (``[rotated evens | rotated odds]``); a permutation applied to q and k
alike leaves every q.k unchanged, so labkit does the same and caches keys in that layout.

This module imports only torch and math: the model and the KV cache may both use it.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 * mscale * ln(scale) + 1`` (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_parameters(rope_scaling: dict[str, Any], dim: int, theta: float,
                    max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] float32, attention_factor) of a YaRN config, as transformers'
    ``_compute_yarn_parameters`` computes them (``factor`` None: the context ratio)."""
    rp = rope_scaling
    orig = rp.get("original_max_position_embeddings", max_position_embeddings)
    factor = rp.get("factor") or max_position_embeddings / orig
    attention_factor = rp.get("attention_factor")
    if attention_factor is None:
        m, m_all = rp.get("mscale"), rp.get("mscale_all_dim")
        attention_factor = (yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all
                            else yarn_mscale(factor))
    beta_fast, beta_slow = rp.get("beta_fast") or 32, rp.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:  # the pair index that turns this often
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rp.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolate = 1 - ramp  # 1: keep the trained frequency, 0: interpolate by the factor
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate
    return inv_freq, float(attention_factor)


def yarn_softmax_scale(rope_scaling: dict[str, Any] | None) -> float:
    """The factor DeepSeek's attention multiplies its softmax scale by: ``mscale(factor,
    mscale_all_dim)^2`` under YaRN with ``mscale_all_dim`` set, else 1."""
    if not rope_scaling or rope_type(rope_scaling) == "default":
        return 1.0
    m_all = rope_scaling.get("mscale_all_dim", 0)
    return yarn_mscale(rope_scaling["factor"], m_all) ** 2 if m_all else 1.0


def rope_type(rope_scaling: dict[str, Any] | None) -> str:
    """The rope type a config's ``rope_scaling`` / ``rope_parameters`` names."""
    if not rope_scaling:
        return "default"
    return rope_scaling.get("rope_type", rope_scaling.get("type", "default"))


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                           ) -> torch.Tensor:
    """Rotate pairs (x_2i, x_2i+1); the result is de-interleaved, ``[evens' | odds']``, exactly
    as transformers' ``apply_rotary_pos_emb_interleave``. x [B,T,H,D], cos/sin [B,T,D] (halves
    repeated, as :func:`labkit.model.llama.rope_cos_sin` makes them)."""
    half = x.shape[-1] // 2
    c, s = cos[:, :, None, :half], sin[:, :, None, :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

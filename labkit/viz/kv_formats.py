"""KV bytes per token, layout by layout, for one model shape: the chart behind "MLA caches 57x
less than MHA".

A 2026 model's KV layout decides how many long requests fit on a GPU, and each family cuts a
different factor of ``2 x layers x kv_heads x head_dim x bytes``: GQA and MQA the KV heads, MLA
replaces per-head K and V by one latent per token, a sliding window caps the tokens a layer
keeps, FP8 halves the bytes. This module puts all of them side by side for one shape (a
simulator preset: ``labkit.sim.presets``), and computes nothing itself: every number is what
labkit's own accounting says, the simulator's :meth:`ModelPreset.kv_bytes` (what the capacity
table uses; MLA's latent, a sliding layer's window) and, for FP8, the engine's allocator
:func:`labkit.kv.cache.kv_bytes_per_block` (one byte per element plus an fp16 scale per token
and head, as ``kv_cache_dtype="fp8"`` stores it).
"""

from __future__ import annotations

from dataclasses import fields, replace
from typing import Any

import plotly.graph_objects as go
import torch

from labkit.kv.cache import kv_bytes_per_block
from labkit.sim.presets import ModelPreset, MoEPreset, get_model_preset

__all__ = ["LAYOUTS", "kv_format_rows", "kv_formats_figure"]

LAYOUTS = ("MHA", "GQA", "MQA", "MLA", "sliding window", "FP8 (GQA)")
LAYOUT_COLORS = ("#4c78a8", "#72b7b2", "#54a24b", "#e45756", "#f58518", "#b279a2")
DEFAULT_GQA_KV_HEADS = 8       # when the preset itself has no fewer KV heads than heads
DEFAULT_WINDOW = 4096          # Mistral-7B's, when the preset has no sliding layers
DEEPSEEK_MLA = (512, 64)       # DeepSeek-V3's kv_lora_rank and qk_rope_head_dim


def _plain(base: ModelPreset, kv_heads: int) -> ModelPreset:
    """The same shape with ``kv_heads`` per-head K/V on every layer: no latent, no window."""
    extra = {"kv_lora_rank": 0} if isinstance(base, MoEPreset) else {}
    return replace(base, num_kv_heads=kv_heads, sliding_window=0, num_sliding_layers=0, **extra)


def _latent(base: ModelPreset, kv_lora_rank: int, rope: int) -> MoEPreset:
    """The same shape with MLA on every layer (a dense preset becomes a latent one: only the
    attention's KV accounting reads these fields)."""
    shape = {f.name: getattr(base, f.name) for f in fields(ModelPreset)}
    shape.update(sliding_window=0, num_sliding_layers=0)
    if isinstance(base, MoEPreset):
        return replace(base, **shape, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope)
    return MoEPreset(**shape, kv_lora_rank=kv_lora_rank, qk_rope_head_dim=rope)


def _kv_elem_bytes(base: ModelPreset) -> int:
    """Bytes of one cached value: DeepSeek-V3 keeps a bf16 cache beside FP8 weights."""
    return getattr(base, "kv_dtype_bytes", 0) or base.dtype_bytes


def _variants(base: ModelPreset, gqa: int, window: int, n_sliding: int, mla: tuple[int, int]
              ) -> dict[str, tuple[ModelPreset, str]]:
    h, d, L = base.num_heads, base.head_dim, base.num_layers
    return {
        "MHA": (_plain(base, h), f"{h} KV heads of {d}"),
        "GQA": (_plain(base, gqa), f"{gqa} KV heads of {d} (x{h // gqa} query heads each)"),
        "MQA": (_plain(base, 1), f"1 KV head of {d}"),
        "MLA": (_latent(base, *mla), f"latent {mla[0]} + shared RoPE key {mla[1]}"),
        "sliding window": (replace(_plain(base, gqa), sliding_window=window,
                                   num_sliding_layers=n_sliding),
                           f"GQA, window {window} on {n_sliding} of {L} layers"),
    }


def kv_format_rows(model: str | ModelPreset = "deepseek-v3", context_len: int = 32768,
                   gqa_kv_heads: int | None = None, window: int | None = None,
                   kv_lora_rank: int | None = None, qk_rope_head_dim: int | None = None
                   ) -> list[dict[str, Any]]:
    """One row per layout of :data:`LAYOUTS` for ``model``'s shape: ``bytes_per_token`` (all
    layers; for the sliding layout the average over a ``context_len``-token request, since a
    window's cost per token falls as the request grows), ``vs_mha`` and a ``detail`` line.

    Defaults come from the preset where it has them (its KV heads for GQA if fewer than its
    heads, its window and sliding layers, its MLA ranks), else 8 KV heads, window 4096 on every
    layer, DeepSeek-V3's 512 + 64."""
    base = get_model_preset(model)
    if context_len < 1:
        raise ValueError(f"context_len must be >= 1, got {context_len}")
    gqa = gqa_kv_heads or (base.num_kv_heads if base.num_kv_heads < base.num_heads
                           and not getattr(base, "kv_lora_rank", 0) else DEFAULT_GQA_KV_HEADS)
    if not 1 <= gqa <= base.num_heads or base.num_heads % gqa:
        raise ValueError(f"gqa_kv_heads must divide the {base.num_heads} heads, got {gqa}")
    w = window or base.sliding_window or DEFAULT_WINDOW
    n_sliding = base.num_sliding_layers or base.num_layers
    mla = (kv_lora_rank or getattr(base, "kv_lora_rank", 0) or DEEPSEEK_MLA[0],
           qk_rope_head_dim or getattr(base, "qk_rope_head_dim", 0) or DEEPSEEK_MLA[1])
    rows = [{"layout": name, "detail": detail,
             "bytes_per_token": preset.kv_bytes(context_len) / context_len}
            for name, (preset, detail) in _variants(base, gqa, w, n_sliding, mla).items()]
    fp8 = kv_bytes_per_block(base.num_layers, 1, gqa, base.head_dim, torch.bfloat16, "fp8")
    rows.append({"layout": "FP8 (GQA)", "bytes_per_token": float(fp8),
                 "detail": f"{gqa} KV heads, e4m3 codes + an fp16 scale per token and head"})
    mha = rows[0]["bytes_per_token"]
    for r in rows:  # FP8's bytes mix 1-byte codes and 2-byte scales: no "values" count
        per_layer = r["bytes_per_token"] / base.num_layers
        r.update(model=base.name, context_len=context_len, vs_mha=r["bytes_per_token"] / mha,
                 bytes_per_token_per_layer=per_layer,
                 values_per_token_per_layer=None if r["layout"] == "FP8 (GQA)"
                 else per_layer / _kv_elem_bytes(base))
    return rows


def kv_formats_figure(model: str | ModelPreset = "deepseek-v3", context_len: int = 32768,
                      log_y: bool = False, **shape: Any) -> go.Figure:
    """A bar per layout: KiB of KV per token (``shape``: :func:`kv_format_rows`' overrides).
    The rows are in ``fig.layout.meta["rows"]`` for code that wants the numbers."""
    rows = kv_format_rows(model, context_len, **shape)
    kib = [r["bytes_per_token"] / 1024 for r in rows]
    fig = go.Figure(go.Bar(
        x=[r["layout"] for r in rows], y=kib, marker_color=list(LAYOUT_COLORS),
        text=[f"{k:,.1f} KiB<br>{r['vs_mha']:.1%} of MHA" for k, r in zip(kib, rows)],
        textposition="outside", cliponaxis=False,
        hovertext=[f"<b>{r['layout']}</b>: {r['detail']}<br>{r['bytes_per_token']:,.0f} bytes "
                   f"per token ({r['bytes_per_token_per_layer']:,.0f} bytes per layer)"
                   for r in rows], hoverinfo="text"))
    name = rows[0]["model"]
    fig.update_layout(
        title=f"KV cache per token, {name} shape ({context_len:,}-token request)",
        yaxis_title="KiB per token (all layers)", height=420, width=760, showlegend=False,
        yaxis_type="log" if log_y else "linear", meta={"rows": rows})
    return fig

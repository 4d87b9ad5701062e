"""Latent attention over the paged cache: what a DeepSeek (MLA) layer's blocks hold and how a step
reads them. PyTorch references; the model side is :mod:`labkit.model.mla`.

**The layout.** A latent layer's block is ``[block_size, 1, latent_dim]``: per token the
normalised latent ``c`` (``kv_lora_rank`` values) then the rotated shared key ``k_pe``
(``qk_rope_head_dim``), one "head" wide, and no V block at all. Slots, block tables, the prefix
cache, copy-on-write and swapping are exactly those of a K/V layer (a block is a block), so the
scheduler and the block manager never learn that a layer is latent. DeepSeek-V3 in bf16:
576 x 2 = 1,152 bytes per token and layer, against 2 x 128 x 128 x 2 = 65,536 for the per-head
K and V of MHA with the same heads.

**A step** (:func:`mla_paged_attention`) splits its chunks as vLLM's MLA backend does:

- single-token chunks (decode) go through :func:`mla_decode_absorbed` together (or the attention
  backend's ``mla_decode``: the Triton kernel ``labkit.kernels.mla_decode``): ``W_UK`` folded
  into the query, scores read against the cached latents in place, ``W_UV`` applied once to the
  weighted latent (memory-bound: read 576 values per cached token, expand nothing);
- multi-token chunks (prefill, chunked prefill, a speculative verify pass) expand their
  sequence's cached latents to per-head K and V and run causal attention
  (``MLAttention.attend_expanded``: compute-bound, so the cheaper FLOPs win).

:func:`mla_decode_expanded` is the decode done the prefill way, the reference the absorbed path
is tested against on real latents.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from labkit.kv.metadata import AttentionMetadata
from labkit.kv.ops import gather_blocks
from labkit.model.mla import MLAttention


def reshape_and_cache_latent(kv_latent: torch.Tensor, cache: torch.Tensor,
                             slot_mapping: torch.Tensor) -> None:
    """Write kv_latent [N, latent_dim] into cache [num_blocks, block_size, 1, latent_dim] at
    the slots (slot -1: a padding token, not stored)."""
    slots = slot_mapping.long()
    keep = slots >= 0
    if not bool(keep.all()):
        slots, kv_latent = slots[keep], kv_latent[keep]
    cache.view(-1, cache.shape[-1]).index_copy_(0, slots, kv_latent.to(cache.dtype))


def gather_latents(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, 1, L] through block tables [B, M] (or [M]) -> [B, M*bs, L] (or
    [M*bs, L]): each sequence's cached latents in position order."""
    return gather_blocks(cache, block_tables)[..., 0, :]


def _valid(context_lens: torch.Tensor, S: int) -> torch.Tensor:
    """[B, S] True where key position s < context_lens[b]."""
    return torch.arange(S, device=context_lens.device)[None, :] < context_lens[:, None].long()


def mla_decode_absorbed(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor,
                        w_uk: torch.Tensor, w_uv: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence over its paged latents, never expanding them.

    q_nope [B,H,dn], q_pe [B,H,dr]; w_uk [H,dn,C], w_uv [H,dv,C] (C = kv_lora_rank); returns
    [B,H,dv]. ``score_s = (W_UK^T q_nope) . c_s + q_pe . k_pe_s``; ``out = W_UV sum_s p_s c_s``."""
    kv = gather_latents(cache, block_tables).float()  # [B,S,C+dr]
    C = w_uk.shape[-1]
    c, k_pe = kv[..., :C], kv[..., C:]
    q_lat = torch.einsum("bhd,hdc->bhc", q_nope.float(), w_uk.float())  # W_UK absorbed
    scores = (torch.einsum("bhc,bsc->bhs", q_lat, c)
              + torch.einsum("bhr,bsr->bhs", q_pe.float(), k_pe)) * scale
    scores = scores.masked_fill(~_valid(context_lens, kv.shape[1])[:, None, :], float("-inf"))
    o_lat = torch.einsum("bhs,bsc->bhc", scores.softmax(dim=-1), c)  # attend in latent space
    return torch.einsum("bhc,hvc->bhv", o_lat, w_uv.float()).to(q_nope.dtype)  # W_UV after


def mla_decode_expanded(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                        block_tables: torch.Tensor, context_lens: torch.Tensor,
                        mla: MLAttention) -> torch.Tensor:
    """The same decode by expanding every cached latent to per-head K and V first (the
    reference for :func:`mla_decode_absorbed`). Returns [B,H,dv]."""
    kv = gather_latents(cache, block_tables)
    k, v = mla.expand_kv(kv)  # [B,S,H,dn+dr], [B,S,H,dv]
    q = torch.cat([q_nope, q_pe], dim=-1)[:, :, None].float()  # [B,H,1,dn+dr]
    mask = _valid(context_lens, kv.shape[1])[:, None, None, :]
    out = F.scaled_dot_product_attention(q, k.float().transpose(1, 2), v.float().transpose(1, 2),
                                         attn_mask=mask, scale=mla.scale)
    return out[:, :, 0].to(q_nope.dtype)


def _plan(meta: AttentionMetadata) -> tuple[torch.Tensor | None, torch.Tensor | None,
                                             list[tuple[int, int, int, int]]]:
    """The step's split, built once (first latent layer) and kept in ``meta.scratch``:
    (decode rows, their sequences, [(sequence, first row, rows, context)] of prefill chunks)."""
    plan = meta.scratch.get("mla_plan")
    if plan is not None:
        return plan
    qlens = meta.query_lens_host or torch.diff(meta.query_start_loc).tolist()
    ctx = meta.context_lens_host or meta.context_lens.tolist()
    starts = [0]
    for n in qlens:
        starts.append(starts[-1] + n)
    dec = [b for b, n in enumerate(qlens) if n == 1]
    dev = meta.slot_mapping.device
    rows = torch.tensor([starts[b] for b in dec], device=dev) if dec else None
    seqs = torch.tensor(dec, device=dev) if dec else None
    chunks = [(b, starts[b], n, ctx[b]) for b, n in enumerate(qlens) if n > 1]
    plan = meta.scratch["mla_plan"] = (rows, seqs, chunks)
    return plan


def mla_paged_attention(q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                        meta: AttentionMetadata, mla: MLAttention,
                        decode: Callable[..., torch.Tensor] | None = None) -> torch.Tensor:
    """A packed step's latent attention, q [N,H,*] -> [N,H,dv]: decodes absorbed (``decode``,
    :func:`mla_decode_absorbed`'s signature: the attention backend's ``mla_decode``, e.g. the
    Triton kernel), prefill chunks expanded (see the module docstring). The step's latents are
    already in the cache."""
    rows, seqs, chunks = _plan(meta)
    N, H, _ = q_nope.shape
    out = q_nope.new_empty(N, H, mla.v_head_dim)
    if rows is not None:
        out[rows] = (decode or mla_decode_absorbed)(
            q_nope[rows], q_pe[rows], cache, meta.block_tables[seqs], meta.context_lens[seqs],
            mla.w_uk(), mla.w_uv(), mla.scale)
    bs = cache.shape[1]
    for b, start, n, ctx in chunks:
        kv = gather_latents(cache, meta.block_tables[b, :-(-ctx // bs)])[:ctx]
        q = slice(start, start + n)
        out[q] = mla.attend_expanded(q_nope[None, q], q_pe[None, q], kv[None])[0]
    return out

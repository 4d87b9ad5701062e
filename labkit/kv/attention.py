"""Paged attention: the backend interface and its PyTorch reference implementation.

The KV of every layer lives in ``k_cache, v_cache: [num_blocks, block_size, num_kv_heads,
head_dim]``. A token's *slot* is ``physical_block * block_size + offset``; a sequence's block
table lists its physical blocks in logical order, so key position p of sequence b sits at slot
``block_tables[b, p // block_size] * block_size + p % block_size``.

Every step first writes the new tokens' K/V into their slots (``reshape_and_cache``), then
attention reads everything, old and new, from the cache:
- ``decode``: one query per sequence attending to its ``context_lens[b]`` keys;
- ``prefill``: packed variable-length queries (``query_start_loc`` like flash-attention's
  cu_seqlens) at the *end* of each sequence's context, causal. This is what chunked prefill and
  prefix-cache hits need: the queries are only the new chunk, the keys include the cached part.

The torch backend is the readable reference (gather the blocks a step reads, build the mask,
``scaled_dot_product_attention``); its masks and index plans are built once per step. The Triton
backend (``labkit.kernels.backend.TritonBackend``) implements the same protocol with kernels that
read blocks in place instead of gathering them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F

from labkit.errors import EngineConfigError
from labkit.kv.backends import registered_backends
from labkit.kv.metadata import AttentionMetadata
from labkit.kv.mla import mla_decode_absorbed
from labkit.kv.ops import gather_blocks, quantize_kv_per_head
from labkit.model.sinks import attention_with_sinks


class AttentionBackend(Protocol):
    """What the paged KV cache calls per layer; the torch and Triton backends match it exactly
    (a test compares their signatures). ``k_scale``/``v_scale`` ([num_blocks, block_size, Hkv]
    fp16) come with an INT8 cache (``kv_cache_dtype="int8"``): reshape_and_cache quantizes into
    them, attention reads them. ``meta`` is the step's AttentionMetadata (built once per step), for
    per-step plans a backend caches in ``meta.scratch``. ``sliding_window`` limits how far back a
    query sees; the paged cache passes each layer's own (the model's layer specs: every layer for
    Mistral, some for Qwen2 / ``layer_types``), None for full attention. Both backends take it.
    ``sinks`` [Hq] (gpt-oss's per-head sink logits, :mod:`labkit.model.sinks`) join each
    softmax's denominator; both backends implement them."""

    name: str

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None,
                          meta: AttentionMetadata | None = None) -> None: ...

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
               meta: AttentionMetadata | None = None,
               sliding_window: int | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor: ...

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                context_lens: torch.Tensor, scale: float,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                meta: AttentionMetadata | None = None,
                sliding_window: int | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor: ...

    def mla_decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                   block_tables: torch.Tensor, context_lens: torch.Tensor, w_uk: torch.Tensor,
                   w_uv: torch.Tensor, scale: float) -> torch.Tensor:
        """Absorbed latent-attention decode (a DeepSeek MLA layer's single-token chunks, see
        :func:`labkit.kv.mla.mla_decode_absorbed`): q_nope [B,H,dn], q_pe [B,H,dr] over the
        latent cache [num_blocks, bs, 1, C + dr] -> [B,H,dv]."""
        ...


def decode_mask(context_lens: torch.Tensor, num_keys: int,
                 sliding_window: int | None) -> torch.Tensor:
    """[B, S] bool: key position s is visible to sequence b's single query."""
    pos = torch.arange(num_keys, device=context_lens.device)
    ctx = context_lens.long()[:, None]
    mask = pos[None, :] < ctx
    if sliding_window is not None:
        mask &= pos[None, :] >= ctx - sliding_window
    return mask


@dataclass
class _PrefillPlan:
    """How a varlen step maps onto the padded tensors; the same for every layer of the step."""

    single_tok: torch.Tensor | None  # packed index of each 1-token chunk's query
    single_bt: torch.Tensor | None
    single_mask: torch.Tensor | None  # [Bs, S]
    multi_bt: torch.Tensor | None  # block tables of the multi-token chunks [Bm, M]
    tok: torch.Tensor | None  # packed index of each multi-chunk query, in padded order
    flat: torch.Tensor | None  # its index in the flattened padded [Bm * Tq] rows
    dense: bool  # no single chunks and all chunks equally long: packed == padded, no copies
    num_multi: int
    max_q: int
    mask: torch.Tensor | None  # [Bm, Tq, S] causal (+ window), padded rows see key 0


def _prefill_plan(block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                  context_lens: torch.Tensor, block_size: int, sliding_window: int | None,
                  meta: AttentionMetadata | None) -> _PrefillPlan:
    dev = block_tables.device
    if meta is not None and meta.query_lens_host is not None:
        q_lens = meta.query_lens_host
    else:
        qsl = query_start_loc.tolist()
        q_lens = [qsl[b + 1] - qsl[b] for b in range(len(qsl) - 1)]
    starts = [0]
    for n in q_lens[:-1]:
        starts.append(starts[-1] + n)
    single = [b for b, n in enumerate(q_lens) if n == 1]
    multi = [b for b, n in enumerate(q_lens) if n > 1]
    S = block_tables.shape[1] * block_size
    s_tok = s_bt = s_mask = None
    if single:
        sel = torch.tensor(single, device=dev)
        s_tok = torch.tensor([starts[b] for b in single], device=dev)
        s_bt = block_tables[sel].long()
        s_mask = decode_mask(context_lens[sel], S, sliding_window)
    if not multi:
        return _PrefillPlan(s_tok, s_bt, s_mask, None, None, None, False, 0, 0, None)
    sel = torch.tensor(multi, device=dev)
    Tq = max(q_lens[b] for b in multi)
    dense = not single and all(q_lens[b] == Tq for b in multi)
    tok = torch.tensor([starts[b] + j for b in multi for j in range(q_lens[b])], device=dev)
    flat = torch.tensor([i * Tq + j for i, b in enumerate(multi) for j in range(q_lens[b])],
                        device=dev)
    ctx = context_lens[sel].long()
    qlen = torch.tensor([q_lens[b] for b in multi], device=dev)
    qpos = ctx[:, None] - qlen[:, None] + torch.arange(Tq, device=dev)[None, :]  # [B,Tq]
    kpos = torch.arange(S, device=dev)
    mask = kpos[None, None, :] <= qpos[:, :, None]  # causal, implies < ctx for real rows
    if sliding_window is not None:
        mask &= kpos[None, None, :] > qpos[:, :, None] - sliding_window
    pad_rows = torch.arange(Tq, device=dev)[None, :] >= qlen[:, None]
    mask[:, :, 0] |= pad_rows  # padded query rows: keep softmax finite, result discarded
    return _PrefillPlan(s_tok, s_bt, s_mask, block_tables[sel].long(), tok, flat, dense,
                        len(multi), Tq, mask)


def _cached(meta: AttentionMetadata | None, key: tuple, build: Any) -> Any:
    """Build once per step (first layer), reuse in the others; no metadata: build every call."""
    if meta is None:
        return build()
    val = meta.scratch.get(key)
    if val is None:
        val = meta.scratch[key] = build()
    return val


class TorchBackend:
    """Readable reference: gather the blocks a step reads, mask, attend, all in fp32.

    ``meta`` (optional) is the step's AttentionMetadata: index tensors and masks are then built
    by the first layer and reused by the rest. ``k_scale``/``v_scale`` (optional) mark an INT8
    cache: ``reshape_and_cache`` quantizes each new (token, head) vector at its slot and the
    attention paths dequantize what they gather."""

    name = "torch"

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None,
                          meta: AttentionMetadata | None = None) -> None:
        slots = slot_mapping.long()
        padded = _cached(meta, ("padded",), lambda: not bool((slots >= 0).all()))
        if padded:  # slot -1 = padding token, not stored
            keep = slots >= 0
            slots, key, value = slots[keep], key[keep], value[keep]
        H, D = k_cache.shape[2], k_cache.shape[3]
        if k_scale is not None:
            key, ks = quantize_kv_per_head(key, k_cache.dtype)
            value, vs = quantize_kv_per_head(value, v_cache.dtype)
            k_scale.view(-1, H).index_copy_(0, slots, ks.to(k_scale.dtype))
            v_scale.view(-1, H).index_copy_(0, slots, vs.to(v_scale.dtype))
        for cache, new in ((k_cache, key), (v_cache, value)):
            new = new.to(cache.dtype)
            if cache.element_size() == 1 and cache.dtype != torch.int8:  # fp8: no CPU
                cache, new = cache.view(torch.uint8), new.view(torch.uint8)  # index_copy_
            cache.view(-1, H, D).index_copy_(0, slots, new)

    @staticmethod
    def _attend_one(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, mask: torch.Tensor, scale: float,
                    k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
        """One query per sequence: q [B,Hq,D] over the gathered keys, mask [B,S]."""
        B, Hq, D = q.shape
        k = gather_blocks(k_cache, block_tables, k_scale, q.dtype)  # [B,S,Hkv,D]
        v = gather_blocks(v_cache, block_tables, v_scale, q.dtype)
        args = (q.float()[:, :, None], k.float().transpose(1, 2), v.float().transpose(1, 2))
        if sinks is not None:
            out = attention_with_sinks(*args, mask[:, None, None, :], scale, sinks)
        else:
            out = F.scaled_dot_product_attention(
                *args, attn_mask=mask[:, None, None, :], scale=scale, enable_gqa=True)
        return out.reshape(B, Hq, D).to(q.dtype)  # out [B,Hq,1,D]

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
               meta: AttentionMetadata | None = None,
               sliding_window: int | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        S = block_tables.shape[1] * k_cache.shape[1]
        mask = _cached(meta, ("decode_mask", sliding_window),
                       lambda: decode_mask(context_lens, S, sliding_window))
        bt = _cached(meta, ("bt_long",), block_tables.long)
        return self._attend_one(q, k_cache, v_cache, bt, mask, scale, k_scale, v_scale, sinks)

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                context_lens: torch.Tensor, scale: float,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                meta: AttentionMetadata | None = None,
                sliding_window: int | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Varlen causal attention over the cache. Single-token queries take the decode path;
        the multi-token chunks are padded to the longest one and masked."""
        N, Hq, D = q.shape
        plan = _cached(meta, ("prefill_plan", sliding_window), lambda: _prefill_plan(
            block_tables, query_start_loc, context_lens, k_cache.shape[1], sliding_window, meta))
        if plan.dense:  # e.g. a verify pass where every sequence scores γ+1 tokens
            qp = q.view(plan.num_multi, plan.max_q, Hq, D)
            return self._attend_multi(qp, k_cache, v_cache, plan, scale, k_scale,
                                      v_scale, sinks).reshape(N, Hq, D)
        out = torch.empty_like(q)
        if plan.single_tok is not None:
            out[plan.single_tok] = self._attend_one(q[plan.single_tok], k_cache, v_cache,
                                                    plan.single_bt, plan.single_mask, scale,
                                                    k_scale, v_scale, sinks)
        if plan.num_multi:
            B, Tq = plan.num_multi, plan.max_q
            qp = q.new_zeros(B * Tq, Hq, D)
            qp[plan.flat] = q[plan.tok]
            o = self._attend_multi(qp.view(B, Tq, Hq, D), k_cache, v_cache, plan, scale,
                                   k_scale, v_scale, sinks)
            out[plan.tok] = o.reshape(B * Tq, Hq, D)[plan.flat]
        return out

    @staticmethod
    def _attend_multi(qp: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      plan: _PrefillPlan, scale: float, k_scale: torch.Tensor | None,
                      v_scale: torch.Tensor | None, sinks: torch.Tensor | None = None
                      ) -> torch.Tensor:
        """Padded chunks qp [B,Tq,Hq,D] over their sequences' gathered keys."""
        k = gather_blocks(k_cache, plan.multi_bt, k_scale, qp.dtype)
        v = gather_blocks(v_cache, plan.multi_bt, v_scale, qp.dtype)
        args = (qp.float().transpose(1, 2), k.float().transpose(1, 2), v.float().transpose(1, 2))
        if sinks is not None:
            o = attention_with_sinks(*args, plan.mask[:, None], scale, sinks)
        else:
            o = F.scaled_dot_product_attention(*args, attn_mask=plan.mask[:, None], scale=scale,
                                               enable_gqa=True)  # [B,Hq,Tq,D]
        return o.transpose(1, 2).to(qp.dtype)

    def mla_decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                   block_tables: torch.Tensor, context_lens: torch.Tensor, w_uk: torch.Tensor,
                   w_uv: torch.Tensor, scale: float) -> torch.Tensor:
        return mla_decode_absorbed(q_nope, q_pe, cache, block_tables, context_lens, w_uk, w_uv,
                                   scale)


def get_attention_backend(name: str | None = "torch") -> AttentionBackend:
    """``"torch"`` (reference, any device) or ``"triton"`` (labkit.kernels; GPU, or CPU under
    TRITON_INTERPRET=1; registered in :mod:`labkit.kv.backends`)."""
    if name in (None, "torch"):
        return TorchBackend()
    factories = registered_backends()
    if name not in factories:
        raise EngineConfigError(f"unknown attention backend {name!r}; choose one of "
                                f"{['torch', *sorted(factories)]}")
    return factories[name]()

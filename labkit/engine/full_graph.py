"""Full decode graphs: a step where every sequence decodes one token runs as one graph.

The pieces of :mod:`labkit.engine.piecewise` leave attention outside the graphs, because a
step's attention layout (block tables, context lengths, chunks of any length) changes every
step. That costs, per layer and step, a trip through Python into the cache's ``attend``: two
slot writes, two block gathers, a mask, an attention call. On labkit-tiny at batch 1 that is a
third of the forward, more than the weights take to read.

A *uniform decode* step is regular enough to capture whole. Every sequence brings one query,
so the only shapes that vary are the batch (padded to a capture size, as for the pieces) and
the block-table width, padded here to a power of two (a *block bucket*: one graph per batch
size and bucket, and per pool size: the cache tensors are graph inputs of fixed shape).
Inside the graph each layer writes its new K/V into the paged pool in place (``index_copy_``
on the cache tensors, which inductor keeps in place), gathers its blocks, and
attends under a mask built from the context lengths, so the positions a bucket pads past a
sequence's end carry no weight. vLLM does this on a GPU: its ``cudagraph_mode`` ``FULL_AND_
PIECEWISE`` (V1's default) captures uniform decode batches as full CUDA graphs, attention
inside, and runs other steps piecewise.

Attention itself, on float32 CPU caches and in a step that attends over enough keys
(``KERNEL_MIN_KEYS``), is a hand-written C++ kernel the graph calls as one op
(``labkit::paged_decode_cpu``, :mod:`labkit.kernels.paged_decode_cpu`): it reads each sequence's
own keys, not the bucket's, and is 4-6x faster than the loops inductor makes of the same
attention written as products and sums (:func:`paged_decode_attention`). Smaller steps, other
dtypes and head sizes run those loops: there the op's call out of the graph costs more than it
saves. vLLM's graphs call their attention kernels as custom ops the same way, and pick kernels
by the batch's shape.

Padded rows copy the batch's first row (token, position, slot, block table), so they compute the
same K/V and write the same values into the same slot: a padded step changes nothing a real row
did not. Steps that are not uniform decodes, and caches whose attention the graph does not
implement (quantized, hybrid groups, latent (MLA) layers, sink logits, a backend other than the
torch one), run piecewise; :func:`full_graph_refusal` says why.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from labkit.engine.graph_capture import Piece
from labkit.engine.pieces import post_attention, pre_attention
from labkit.kernels import paged_decode_cpu
from labkit.kv.attention import TorchBackend, decode_mask

FULL_MAX_TOKENS = 4096  # the largest context a bucket covers (its gathers grow with it)
MIN_BUCKET_BLOCKS = 4  # the smallest bucket: fewer graphs to compile for short contexts
# From how many keys a step (sequences x bucket) attends through the C++ kernel: below it the
# op's call out of the graph (about 60 us a layer, with what it keeps inductor from fusing)
# costs more than inductor's loops. Measured on labkit-tiny, 1 thread: loops faster at 8 x
# 128 keys, the kernel at 16 x 128 and 32 x 64 (labkit bench step's compiled variants).
KERNEL_MIN_KEYS = 2048
KERNEL = "C++ kernel"  # a full graph's attention in CompileReport.full_attention


def full_graph_refusal(model: nn.Module, kv_cache: Any) -> str | None:
    """Why a decode step with this model and cache runs piecewise (None: as a full graph)."""
    return step_refusal(model, kv_cache) or static_refusal(model, kv_cache)


def static_refusal(model: nn.Module, kv_cache: Any) -> str | None:
    """The part of :func:`full_graph_refusal` fixed when the cache is made (its backend, dtype,
    scales, latent layers; the model's sinks): checked once per cache, not every step."""
    if type(getattr(kv_cache, "backend", None)) is not TorchBackend:
        return "the full graph implements the paged cache of the torch attention backend"
    if kv_cache.k_scales:
        return "hybrid groups and quantized KV caches attend outside the graph"
    if any(w is not None for w in kv_cache.kv_latent_dims):
        return "latent attention (MLA) layers attend outside the graph"
    if any(getattr(layer.self_attn, "sinks", None) is not None for layer in model.model.layers):
        return "attention-sink logits are added outside the graph"
    if kv_cache.k_caches[0].dtype != model.dtype:
        return "a KV cache of another dtype than the model's"
    return None


def step_refusal(model: nn.Module, kv_cache: Any) -> str | None:
    """The part of :func:`full_graph_refusal` that can change between steps: a KV connector
    wrapping the cache, a hybrid step's per-group metadata, hooks on the final norm."""
    if "attend" in vars(kv_cache):  # labkit.kv.connector.base wraps it per cache object
        return "a KV connector's per-layer loads and saves wrap the cache's attend"
    if kv_cache.metas:
        return "hybrid groups and quantized KV caches attend outside the graph"
    norm = model.model.norm
    if norm._forward_hooks or norm._forward_pre_hooks:
        return ("hooks on the final norm (EAGLE's feature capture, the profiler's per-layer "
                "timers) need it eager")
    return None


def block_bucket(width: int) -> int:
    """The padded block-table width for ``width`` blocks: the next power of two, at least
    ``MIN_BUCKET_BLOCKS`` (each bucket is a graph to compile; a few masked blocks cost less)."""
    return max(1 << max(width - 1, 0).bit_length(), MIN_BUCKET_BLOCKS)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, mask: torch.Tensor, scale: float
                           ) -> torch.Tensor:
    """One query per sequence over its blocks, written out (gather, scores, masked softmax,
    weighted sum) so inductor fuses it: q [B,Hq,D], caches [blocks,bs,Hkv,D] -> [B,Hq,D]."""
    B, Hq, D = q.shape
    Hkv = k_cache.shape[2]
    flat = block_tables.reshape(-1)
    k = k_cache.index_select(0, flat).view(B, -1, Hkv, D).float()
    v = v_cache.index_select(0, flat).view(B, -1, Hkv, D).float()
    qg = q.float().view(B, Hkv, Hq // Hkv, D)
    # products and sums, not matmuls: inductor fuses the block gather into the loops, so the
    # gathered keys and values are never written out (a bmm would need them materialized)
    scores = (qg[:, None] * k[:, :, :, None, :]).sum(-1) * scale  # [B,S,Hkv,G]
    scores = scores.masked_fill(~mask[:, :, None, None], float("-inf")).softmax(1)
    out = (scores[..., None] * v[:, :, :, None, :]).sum(1)  # [B,Hkv,G,D]
    return out.reshape(B, Hq, D).to(q.dtype)


def kernel_refusal(model: nn.Module, kv_cache: Any, size: int, bucket: int) -> str | None:
    """Why the full graph of ``size`` sequences and ``bucket`` blocks attends with inductor's
    loops, not the C++ kernel (None: the kernel): a dtype or head size the kernel does not
    take, or too few keys for it to pay for its call out of the graph (``KERNEL_MIN_KEYS``)."""
    head_dim = kv_cache.k_caches[0].shape[-1]
    why = paged_decode_cpu.supports(torch.empty(0, head_dim, dtype=model.dtype,
                                                device=model.device), kv_cache.k_caches[0])
    keys = size * bucket * kv_cache.block_size
    if why is None and keys < KERNEL_MIN_KEYS:
        why = f"{size} x {bucket * kv_cache.block_size} keys < {KERNEL_MIN_KEYS}"
    return why


class DecodeStep:
    """The function a full graph is traced from: ``(*templates, *args)`` -> logits [B, V].
    Templates: the L layers, the final norm, the LM head, the token embedding; args: the token
    ids, positions, cos, sin, slot mapping, block tables, context lengths, then the L K caches
    and the L V caches. ``rope_table``: cos and sin are the model's rotary tables
    (:func:`labkit.model.fuse.use_rope_table`), looked up in the graph (else the step's own).
    ``kernel``: attention as the C++ op (else as products and sums under a mask)."""

    def __init__(self, num_layers: int, windows: list[int | None], scale: float,
                 kernel: bool, rope_table: bool) -> None:
        self.L, self.windows, self.scale, self.kernel = num_layers, windows, scale, kernel
        self.rope_table = rope_table

    def __call__(self, *templates_and_args: Any) -> torch.Tensor:
        L = self.L
        layers, (norm, head, embed) = templates_and_args[:L], templates_and_args[L:L + 3]
        ids, pos, cos, sin, slots, tables, ctx, *caches = templates_and_args[L + 3:]
        # the embedding and the rotary lookup in the graph: two eager ops fewer per step
        x = embed.forward(ids)
        if self.rope_table:
            cos, sin = cos[pos], sin[pos]
        num_keys = tables.shape[1] * caches[0].shape[1]
        masks = {} if self.kernel else {w: decode_mask(ctx, num_keys, w)
                                        for w in set(self.windows)}
        residual = torch.zeros_like(x)
        for i, layer in enumerate(layers):
            q, k, v, residual = pre_attention(layer, x, residual, cos, sin)
            kc, vc = caches[i], caches[L + i]
            kc.view(-1, *kc.shape[2:]).index_copy_(0, slots, k[0])  # the new token's slot
            vc.view(-1, *vc.shape[2:]).index_copy_(0, slots, v[0])
            if self.kernel:  # reads only each sequence's own keys (window .. context)
                out = torch.ops.labkit.paged_decode_cpu(q[0], kc, vc, tables, ctx, self.scale,
                                                        self.windows[i] or 0)
            else:
                out = paged_decode_attention(q[0], kc, vc, tables, masks[self.windows[i]],
                                             self.scale)
            x, residual = post_attention(layer, out[None], residual)
        return head.forward(norm.forward(x + residual)[0])


def has_rope_table(model: nn.Module) -> bool:
    """The model looks its rotary cos/sin up in a table (the fused cure's precomputed one)."""
    return isinstance(getattr(model, "rope_cos", None), torch.Tensor)


def step_inputs(model: nn.Module) -> tuple[int, ...]:
    """Which of :func:`full_graph_args`' inputs change from step to step (ids, positions,
    slots, block tables, context lengths, and cos/sin without a rotary table); the rest (the
    rotary table, the KV caches) are the same tensors every step. A CUDA graph copies the
    first kind into its buffers and must hold the second as themselves
    (:mod:`labkit.engine.cuda_graph`)."""
    return (0, 1, 4, 5, 6) if has_rope_table(model) else (0, 1, 2, 3, 4, 5, 6)


def pad_rows(t: torch.Tensor, size: int, dim: int = 0) -> torch.Tensor:
    """``t`` with copies of its first row along ``dim`` up to ``size`` rows."""
    n = size - t.shape[dim]
    if n == 0:
        return t
    first = t.narrow(dim, 0, 1)
    return torch.cat([t, first.expand(*[n if d == dim else -1 for d in range(t.dim())])], dim)


def full_graph_args(model: nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                    kv_cache: Any, size: int) -> tuple[int, tuple]:
    """(block bucket, the graph's activation and cache inputs) for a uniform decode step of
    ``input_ids`` [1, B] padded to ``size`` sequences."""
    meta = kv_cache.meta
    ids, pos = pad_rows(input_ids, size, 1), pad_rows(positions, size, 1)
    if has_rope_table(model):  # looked up in the graph
        cos, sin = model.rope_cos, model.rope_sin
    else:
        cos, sin = model.rope(pos, model.dtype)
    width = meta.block_tables.shape[1]
    bucket = block_bucket(width)
    tables = torch.nn.functional.pad(meta.block_tables, (0, bucket - width)).long()
    args = (ids, pos, cos, sin, pad_rows(meta.slot_mapping, size), pad_rows(tables, size),
            pad_rows(meta.context_lens, size).long(), *kv_cache.k_caches, *kv_cache.v_caches)
    return bucket, args


def decode_piece(model: nn.Module, kv_cache: Any, templates: list[nn.Module],
                 kernel: bool) -> Piece:
    """The :class:`Piece` a full graph traces: :class:`DecodeStep` over weightless templates,
    attending through the C++ kernel or not (:func:`kernel_refusal`)."""
    step = DecodeStep(len(model.model.layers), list(kv_cache.sliding_windows), kv_cache.scale,
                      kernel, has_rope_table(model))
    return Piece(step, *templates)


def is_uniform_decode(kv_cache: Any, tokens: int) -> bool:
    """Every sequence of the step decodes one token, within the largest bucket's context."""
    meta = getattr(kv_cache, "meta", None)
    return (meta is not None and meta.decode_only and meta.block_tables.shape[0] == tokens
            and block_bucket(meta.block_tables.shape[1]) * kv_cache.block_size
            <= FULL_MAX_TOKENS)

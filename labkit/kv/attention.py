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

The torch backend is the readable reference (gather the blocks, mask, softmax). The Triton
backend (``labkit.kernels.backend.TritonBackend``) implements the same protocol with kernels that
read blocks in place instead of gathering them.
"""

from __future__ import annotations

from typing import Protocol

import torch


class AttentionBackend(Protocol):
    name: str

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None: ...

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor,
               scale: float) -> torch.Tensor: ...

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                context_lens: torch.Tensor, scale: float) -> torch.Tensor: ...


def _gather(cache: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
    """[num_blocks, bs, H, D] x [B, M] -> each sequence's keys in order, [B, M*bs, H, D]."""
    B, M = block_tables.shape
    g = cache[block_tables.long()]
    return g.reshape(B, M * cache.shape[1], cache.shape[2], cache.shape[3])


class TorchBackend:
    name = "torch"

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        slots = slot_mapping.long()
        keep = slots >= 0
        if not bool(keep.all()):  # slot -1 = padding token, not stored
            slots, key, value = slots[keep], key[keep], value[keep]
        H, D = k_cache.shape[2], k_cache.shape[3]
        k_cache.view(-1, H, D).index_copy_(0, slots, key.to(k_cache.dtype))
        v_cache.view(-1, H, D).index_copy_(0, slots, value.to(v_cache.dtype))

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
               sliding_window: int | None = None) -> torch.Tensor:
        B, Hq, D = q.shape
        Hkv = k_cache.shape[2]
        k, v = _gather(k_cache, block_tables), _gather(v_cache, block_tables)  # [B,S,Hkv,D]
        pos = torch.arange(k.shape[1], device=q.device)
        ctx = context_lens.to(q.device).long()[:, None]
        mask = pos[None, :] < ctx  # [B,S]
        if sliding_window is not None:
            mask &= pos[None, :] >= ctx - sliding_window
        qg = q.float().view(B, Hkv, Hq // Hkv, D)
        scores = torch.einsum("bhgd,bshd->bhgs", qg, k.float()) * scale
        scores.masked_fill_(~mask[:, None, None, :], float("-inf"))
        p = scores.softmax(-1)
        out = torch.einsum("bhgs,bshd->bhgd", p, v.float())
        return out.reshape(B, Hq, D).to(q.dtype)

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                context_lens: torch.Tensor, scale: float,
                sliding_window: int | None = None) -> torch.Tensor:
        """Varlen causal attention over the cache. Single-token queries take the decode path;
        the multi-token chunks are padded to the longest one and masked."""
        N, Hq, D = q.shape
        Hkv = k_cache.shape[2]
        qsl = query_start_loc.tolist()
        q_lens = [qsl[b + 1] - qsl[b] for b in range(len(qsl) - 1)]
        out = torch.empty_like(q)
        single = [b for b, n in enumerate(q_lens) if n == 1]
        multi = [b for b, n in enumerate(q_lens) if n > 1]
        dev = q.device
        if single:
            idx = torch.tensor([qsl[b] for b in single], device=dev)
            sel = torch.tensor(single, device=dev)
            out[idx] = self.decode(q[idx], k_cache, v_cache, block_tables[sel],
                                   context_lens[sel], scale, sliding_window)
        if not multi:
            return out
        sel = torch.tensor(multi, device=dev)
        k, v = _gather(k_cache, block_tables[sel]), _gather(v_cache, block_tables[sel])
        B, S, Tq = len(multi), k.shape[1], max(q_lens[b] for b in multi)
        # packed token -> (row in the padded batch, index within its chunk)
        rows = torch.cat([torch.full((q_lens[b],), i, dtype=torch.long)
                          for i, b in enumerate(multi)]).to(dev)
        tok = torch.cat([torch.arange(qsl[b], qsl[b + 1]) for b in multi]).to(dev)
        within = torch.cat([torch.arange(q_lens[b]) for b in multi]).to(dev)
        qp = q.new_zeros(B, Tq, Hq, D)
        qp[rows, within] = q[tok]
        ctx = context_lens[sel].to(dev).long()
        qlen = torch.tensor([q_lens[b] for b in multi], device=dev)
        qpos = ctx[:, None] - qlen[:, None] + torch.arange(Tq, device=dev)[None, :]  # [B,Tq]
        kpos = torch.arange(S, device=dev)
        mask = kpos[None, None, :] <= qpos[:, :, None]  # causal, implies < ctx for real rows
        if sliding_window is not None:
            mask &= kpos[None, None, :] > qpos[:, :, None] - sliding_window
        pad_rows = torch.arange(Tq, device=dev)[None, :] >= qlen[:, None]
        mask[:, :, 0] |= pad_rows  # padded query rows: keep softmax finite, result discarded
        qg = qp.float().view(B, Tq, Hkv, Hq // Hkv, D)
        scores = torch.einsum("bthgd,bshd->bhgts", qg, k.float()) * scale
        scores.masked_fill_(~mask[:, None, None, :, :], float("-inf"))
        o = torch.einsum("bhgts,bshd->bthgd", scores.softmax(-1), v.float())
        out[tok] = o.reshape(B, Tq, Hq, D)[rows, within].to(q.dtype)
        return out


def get_attention_backend(name: str | None = "torch") -> AttentionBackend:
    """``"torch"`` (reference, any device) or ``"triton"`` (labkit.kernels; GPU, or CPU under
    TRITON_INTERPRET=1)."""
    if name in (None, "torch"):
        return TorchBackend()
    if name == "triton":
        from labkit.kernels.backend import TritonBackend

        return TritonBackend()
    raise ValueError(f"unknown attention backend {name!r}; choose 'torch' or 'triton'")

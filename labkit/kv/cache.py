"""PagedKVCache: the physical KV tensors and the model's ``attend`` hook for a packed step.

The engine packs every scheduled sequence's new tokens into one row (B=1, T=total new tokens)
and sets an ``AttentionMetadata`` before the forward; each layer's ``attend`` then writes its
K/V into the slots and runs decode or varlen prefill attention through the backend. Building
the metadata once per step (not per layer) is what keeps the per-layer cost to two kernel calls.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from labkit.kv.attention import AttentionBackend, TorchBackend


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [N] int64
    block_tables: torch.Tensor  # [B, max_blocks] int32, 0-padded
    query_start_loc: torch.Tensor  # [B+1] int32
    context_lens: torch.Tensor  # [B] int32
    decode_only: bool  # every sequence has exactly one new token


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    """K and V, every layer: 2 * L * block_size * Hkv * D * bytes."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 backend: AttentionBackend | None = None, num_cpu_blocks: int = 0,
                 sliding_window: int | None = None) -> None:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        self.k_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        cpu_shape = (num_cpu_blocks, block_size, num_kv_heads, head_dim)
        self.cpu_k = [torch.zeros(cpu_shape, dtype=dtype) for _ in range(num_layers if
                                                                          num_cpu_blocks else 0)]
        self.cpu_v = [torch.zeros(cpu_shape, dtype=dtype) for _ in range(len(self.cpu_k))]
        self.backend = backend or TorchBackend()
        self.scale = head_dim ** -0.5
        self.block_size = block_size
        self.sliding_window = sliding_window
        if sliding_window is not None and not isinstance(self.backend, TorchBackend):
            raise ValueError(f"sliding-window attention is only implemented by the torch backend, "
                             f"not {self.backend.name!r}")
        self.meta: AttentionMetadata | None = None

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor) -> torch.Tensor:
        m = self.meta
        kc, vc = self.k_caches[layer_idx], self.v_caches[layer_idx]
        be = self.backend
        be.reshape_and_cache(k[0], v[0], kc, vc, m.slot_mapping)
        kw = {"sliding_window": self.sliding_window} if self.sliding_window is not None else {}
        if m.decode_only:
            out = be.decode(q[0], kc, vc, m.block_tables, m.context_lens, self.scale, **kw)
        else:
            out = be.prefill(q[0], kc, vc, m.block_tables, m.query_start_loc, m.context_lens,
                             self.scale, **kw)
        return out[None]

    # ---- block copies the block manager queued ------------------------------------------------
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: dst <- src in every layer."""
        if not pairs:
            return
        dev = self.k_caches[0].device
        src = torch.tensor([s for s, _ in pairs], device=dev)
        dst = torch.tensor([d for _, d in pairs], device=dev)
        for kc, vc in zip(self.k_caches, self.v_caches):
            kc[dst] = kc[src]
            vc[dst] = vc[src]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(gpu block, cpu block): copy to host memory."""
        if not pairs:
            return
        g = torch.tensor([a for a, _ in pairs], device=self.k_caches[0].device)
        c = torch.tensor([b for _, b in pairs])
        for i in range(len(self.k_caches)):
            self.cpu_k[i][c] = self.k_caches[i][g].cpu()
            self.cpu_v[i][c] = self.v_caches[i][g].cpu()

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(cpu block, gpu block): copy back to device memory."""
        if not pairs:
            return
        dev = self.k_caches[0].device
        c = torch.tensor([a for a, _ in pairs])
        g = torch.tensor([b for _, b in pairs], device=dev)
        for i in range(len(self.k_caches)):
            self.k_caches[i][g] = self.cpu_k[i][c].to(dev)
            self.v_caches[i][g] = self.cpu_v[i][c].to(dev)

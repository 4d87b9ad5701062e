"""INT8 KV cache: halve the cache (vs fp16) by storing K and V as int8 plus small scales.

During decode the KV cache, not the weights, dominates memory traffic at long contexts and large
batches, so quantizing it buys both capacity (more sequences fit) and bandwidth. Two scale
granularities:

* per (token, head): each new token's K/V for each kv head gets ``absmax / 127`` of its own
  ``head_dim`` values. Written once, never revisited — it fits an engine that appends tokens
  (``reshape_and_cache`` quantizes, attention dequantizes); costs one fp16 scale per 64-128 bytes.
* per (block, head): one scale for a whole paged block; fewer scales, but a block's scale must be
  fixed before it is full (or the block re-quantized), so it suits a static, already-filled cache.

:class:`Int8ContiguousKVCache` is a drop-in for the reference ``ContiguousKVCache`` whose K/V go
through per-(token, head) INT8, so the model's accuracy with an INT8 cache can be measured with
no engine changes (``labkit bench quant``).
"""

from __future__ import annotations

import torch

from labkit.kv.ops import dequantize_kv_per_head, quantize_kv_per_head
from labkit.model.layers import layer_sliding_windows
from labkit.model.llama import causal_attention

__all__ = ["Int8ContiguousKVCache", "dequantize_kv_per_block", "dequantize_kv_per_head",
           "quantize_kv_per_block", "quantize_kv_per_head"]


def quantize_kv_per_block(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged cache [num_blocks, block_size, H, D] -> (int8 same shape, fp16 scale [blocks, H])."""
    if cache.dim() != 4:
        raise ValueError("expected a paged cache [num_blocks, block_size, num_kv_heads, "
                         f"head_dim], got shape {tuple(cache.shape)}")
    scale = (cache.float().abs().amax(dim=(1, 3)) / 127).clamp(min=1e-8).half()
    q = torch.round(cache.float() / scale.float()[:, None, :, None]).clamp(-127, 127)
    return q.to(torch.int8), scale


def dequantize_kv_per_block(q: torch.Tensor, scale: torch.Tensor,
                            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()[:, None, :, None]).to(dtype)


class Int8ContiguousKVCache:
    """[B, max_len, Hkv, D] int8 K/V + fp16 scales [B, max_len, Hkv] per layer.
    ``code_dtype=torch.float8_e4m3fn``: the FP8 cache's reference (same scales, e4m3 codes)."""

    def __init__(self, model: torch.nn.Module, batch_size: int, max_len: int,
                 code_dtype: torch.dtype = torch.int8) -> None:
        c = model.config
        shape = (batch_size, max_len, c.num_key_value_heads, c.head_dim)
        dev = model.device
        self.code_dtype = code_dtype
        self.k = [torch.zeros(shape, dtype=code_dtype, device=dev)
                  for _ in range(c.num_hidden_layers)]
        self.v = [torch.zeros_like(t) for t in self.k]
        self.k_scale = [torch.zeros(shape[:3], dtype=torch.float16, device=dev)
                        for _ in range(c.num_hidden_layers)]
        self.v_scale = [torch.zeros_like(t) for t in self.k_scale]
        self.max_len = max_len
        self.sliding_windows = layer_sliding_windows(c)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size()
                   for ts in (self.k, self.v, self.k_scale, self.v_scale) for t in ts)

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        start = int(positions[0, 0])
        end = start + q.shape[1]
        if end > self.max_len:
            raise ValueError(f"KV cache holds {self.max_len} positions, asked for {end}")
        for store, scales, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            qx, s = quantize_kv_per_head(x, self.code_dtype)
            store[layer_idx][:, start:end] = qx
            scales[layer_idx][:, start:end] = s
        kd = dequantize_kv_per_head(self.k[layer_idx][:, :end], self.k_scale[layer_idx][:, :end],
                                    q.dtype)
        vd = dequantize_kv_per_head(self.v[layer_idx][:, :end], self.v_scale[layer_idx][:, :end],
                                    q.dtype)
        return causal_attention(q, kd, vd, self.sliding_windows[layer_idx], sinks=sinks)

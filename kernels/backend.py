"""TritonBackend: the engine's ``AttentionBackend`` protocol served by labkit's Triton kernels.

``labkit.kv.attention.get_attention_backend("triton")`` imports this lazily. On a GPU the kernels
run natively; on CPU they run only under ``TRITON_INTERPRET=1`` (slow, but the same code path,
which is how the tests check the engine end to end).

``k_scale``/``v_scale`` (the engine passes them for ``kv_cache_dtype="int8"`` or ``"fp8"``) mark
a quantized cache, as for the torch backend: ``reshape_and_cache`` quantizes in the kernel (the
same int8 or e4m3 codes and scales as ``labkit.kv.ops.quantize_kv_per_head``, bit for bit) and
the attention kernels dequantize the tiles they read (``labkit.kernels.int8_kv``, and
``labkit.kernels.fp8_kv`` for e4m3's bits). ``sliding_window`` (given per layer by the paged
cache, from the model's layer specs) is the kernels' window mask; None is full attention.
``sinks`` (gpt-oss's per-head sink logits, ``labkit.model.sinks``) start each row's online
softmax as a key of value 0 (split-KV decode adds them once, in the merge), with or without a
window or a quantized cache: the same numbers as the torch backend's ``attention_with_sinks``.
``mla_decode`` is a DeepSeek (MLA) layer's absorbed decode over its latent cache
(``labkit.kernels.mla_decode``); its prefill chunks expand in PyTorch (``labkit.kv.mla``).
"""

from __future__ import annotations

import torch
from labkit.kernels.mla_decode import mla_decode_triton
from labkit.kernels.paged_attention import paged_attention_decode
from labkit.kernels.paged_prefill import paged_prefill_attention
from labkit.kernels.reshape_and_cache import reshape_and_cache


class TritonBackend:
    """Paged attention through Triton kernels; the same methods and signatures as the torch
    backend (``labkit.kv.attention.AttentionBackend``; a test compares them)."""

    name = "triton"

    def reshape_and_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                          k_scale: torch.Tensor | None = None,
                          v_scale: torch.Tensor | None = None, meta: object = None) -> None:
        reshape_and_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)

    def decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
               k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
               meta: object = None, sliding_window: int | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        return paged_attention_decode(q, k_cache, v_cache, block_tables, context_lens, scale,
                                      k_scale=k_scale, v_scale=v_scale,
                                      sliding_window=sliding_window, sinks=sinks)

    def prefill(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                context_lens: torch.Tensor, scale: float,
                k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                meta: object = None, sliding_window: int | None = None,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        # the step's metadata knows the longest chunk on the host: no device read per layer
        max_q = getattr(meta, "max_query_len", None)
        return paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start_loc,
                                       context_lens, scale, max_query_len=max_q,
                                       k_scale=k_scale, v_scale=v_scale,
                                       sliding_window=sliding_window, sinks=sinks)

    def mla_decode(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                   block_tables: torch.Tensor, context_lens: torch.Tensor, w_uk: torch.Tensor,
                   w_uv: torch.Tensor, scale: float) -> torch.Tensor:
        return mla_decode_triton(q_nope, q_pe, cache, block_tables, context_lens, w_uk, w_uv,
                                 scale)

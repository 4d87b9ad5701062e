"""PagedKVCache: the physical KV tensors and the model's ``attend`` hook for a packed step.

The engine packs every scheduled sequence's new tokens into one row (B=1, T=total new tokens)
and sets an ``AttentionMetadata`` before the forward; each layer's ``attend`` then writes its
K/V into the slots and runs decode or varlen prefill attention through the backend. Building
the metadata once per step (not per layer) is what keeps the per-layer cost to two kernel calls.
"""

from __future__ import annotations

import mmap

import torch

from labkit.config import KV_CACHE_DTYPES, CacheConfig
from labkit.kv.attention import AttentionBackend, TorchBackend
from labkit.kv.hybrid import HybridLayout
from labkit.kv.metadata import AttentionMetadata
from labkit.kv.mla import mla_paged_attention, reshape_and_cache_latent
from labkit.kv.ops import FP8_KV_DTYPE, KV_SCALE_DTYPE
from labkit.model.layers import layer_kv_latent_dims, layer_sliding_windows

# the quantized KV caches: their codes' dtype (one byte each, plus an fp16 scale per token
# and head); "fp8" is e4m3, as vLLM's kv_cache_dtype="fp8"
QUANT_KV = {"int8": torch.int8, **({"fp8": FP8_KV_DTYPE} if FP8_KV_DTYPE is not None else {})}

__all__ = ["AttentionMetadata", "KV_CACHE_DTYPES", "PagedKVCache", "build_attention_metadata",
           "kv_bytes_per_block", "model_kv_bytes_per_block"]


def pool_zeros(shape: tuple, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor for the KV pool. On the CPU it lies on an anonymous memory map, whose pages
    the kernel hands out already zeroed when first written: ``torch.zeros`` would write every
    page of a pool sized for ``max_num_seqs`` full-length sequences at start-up (about a tenth
    of a second for labkit-tiny's 192 MiB) though a short run touches a few blocks."""
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or n == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    raw = torch.frombuffer(mmap.mmap(-1, n), dtype=torch.uint8, count=n)  # keeps the map alive
    return raw.view(dtype).view(shape)


def check_kv_cache_dtype(kv_cache_dtype: str) -> str:
    CacheConfig(kv_cache_dtype=kv_cache_dtype)  # raises EngineConfigError if unknown
    return kv_cache_dtype


def build_attention_metadata(slots: list[int], block_tables: list[list[int]],
                             query_lens: list[int], context_lens: list[int],
                             device: torch.device | str) -> AttentionMetadata:
    """One step's metadata from host lists: ``query_lens[b]`` new tokens of sequence b end at
    position ``context_lens[b] - 1``; ``block_tables`` rows are padded with block 0."""
    if not (len(block_tables) == len(query_lens) == len(context_lens)):
        raise ValueError(f"{len(block_tables)} block tables, {len(query_lens)} query lengths, "
                         f"{len(context_lens)} context lengths: one of each per sequence")
    width = max((len(t) for t in block_tables), default=0)
    # -1 (NULL_BLOCK: freed outside a sliding window) reads block 0, as padding does; the
    # window mask gives those positions zero weight, so their contents are never used
    bt = torch.tensor([[max(b, 0) for b in t] + [0] * (width - len(t)) for t in block_tables],
                      dtype=torch.int32, device=device)
    qsl = [0]
    for n in query_lens:
        qsl.append(qsl[-1] + n)
    return AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=bt,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        decode_only=all(n == 1 for n in query_lens),
        query_lens_host=list(query_lens),
        context_lens_host=list(context_lens),
        max_query_len=max(query_lens, default=0),
        max_context_len=max(context_lens, default=0),
    )


def kv_bytes_per_block(num_layers: int, block_size: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype, kv_cache_dtype: str = "auto") -> int:
    """K and V, every layer: 2 * L * block_size * Hkv * D * bytes; an INT8 cache stores one
    byte per element plus a 2-byte scale per (token, head): 2 * L * block_size * Hkv * (D + 2)."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype in QUANT_KV:  # one byte per element (int8 or fp8) + the scales
        scale = torch.empty((), dtype=KV_SCALE_DTYPE).element_size()
        return 2 * num_layers * block_size * num_kv_heads * (head_dim + scale)
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * elem


def model_kv_bytes_per_block(model_config: object, block_size: int, dtype: torch.dtype,
                             kv_cache_dtype: str = "auto") -> int:
    """One block's bytes over every layer of a model, as :class:`PagedKVCache` allocates them:
    a K/V layer as :func:`kv_bytes_per_block` counts it, a latent (MLA) layer
    ``block_size * latent_dim * bytes`` (one latent per token, no V). DeepSeek-V3 in bf16: 576
    values, 1,152 bytes per token and layer; the same 128 heads of 128 as MHA would be 65,536."""
    c = model_config
    latent = layer_kv_latent_dims(c)
    n_kv = sum(w is None for w in latent)
    total = kv_bytes_per_block(n_kv, block_size, c.num_key_value_heads, c.head_dim, dtype,
                               kv_cache_dtype)
    elem = torch.empty((), dtype=dtype).element_size()
    return total + sum(block_size * w * elem for w in latent if w is not None)


def _layer_shapes(n_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                  latent: list[int | None]) -> list[tuple[tuple, tuple]]:
    """(K shape, V shape) per layer: [n, bs, Hkv, D] twice, or for a latent layer of width w
    [n, bs, 1, w] and an empty V (so block copies and swaps need no case for it)."""
    return [((n_blocks, block_size, num_kv_heads, head_dim),) * 2 if w is None
            else ((n_blocks, block_size, 1, w), (n_blocks, block_size, 1, 0)) for w in latent]


def _latent_widths(kv_latent_dims: list[int | None] | None, num_layers: int,
                   kv_cache_dtype: str) -> list[int | None]:
    """One latent width (or None: per-head K/V) per layer, checked."""
    latent = list(kv_latent_dims) if kv_latent_dims is not None else [None] * num_layers
    if len(latent) != num_layers:
        raise ValueError(f"{len(latent)} latent widths for {num_layers} layers")
    if kv_cache_dtype in QUANT_KV and any(w is not None for w in latent):
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is not implemented for latent "
                         "attention (MLA) layers; use kv_cache_dtype='auto'")
    return latent


def _layer_windows(sliding_window: int | None | list[int | None], num_layers: int,
                   backend: str) -> list[int | None]:
    """One window per layer (None = full attention); an int means every layer (Mistral)."""
    windows = (list(sliding_window) if isinstance(sliding_window, (list, tuple))
               else [sliding_window] * num_layers)
    if len(windows) != num_layers:
        raise ValueError(f"{len(windows)} sliding windows for {num_layers} layers")
    if any(w is not None for w in windows) and backend not in ("torch", "triton"):
        raise ValueError(f"sliding-window attention is implemented by the torch and triton "
                         f"backends only, not {backend!r}")
    return windows


class PagedKVCache:
    """Per layer ``k_caches[i], v_caches[i]: [num_blocks, block_size, Hkv, D]``. With
    ``kv_cache_dtype="int8"`` (or ``"fp8"``) those hold int8 (e4m3) codes and ``k_scales[i],
    v_scales[i]: [num_blocks, block_size, Hkv]`` fp16 hold each (token, head)'s scale; block
    copies and swaps move both.

    A latent attention layer (``kv_latent_dims[i]`` = its width, DeepSeek's MLA:
    :mod:`labkit.kv.mla`) caches ``k_caches[i]: [num_blocks, block_size, 1, latent_dim]`` and an
    empty ``v_caches[i]``; its layer calls :meth:`attend_latent` instead of :meth:`attend`."""

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 backend: AttentionBackend | None = None, num_cpu_blocks: int = 0,
                 sliding_window: int | None | list[int | None] = None,
                 kv_cache_dtype: str = "auto",
                 kv_latent_dims: list[int | None] | None = None,
                 layout: HybridLayout | None = None) -> None:
        self.backend = backend or TorchBackend()
        self.layout = layout  # per-group block tables (labkit.kv.hybrid_manager) or None
        self.kv_cache_dtype = check_kv_cache_dtype(kv_cache_dtype)
        quant = kv_cache_dtype in QUANT_KV
        latent = _latent_widths(kv_latent_dims, num_layers, kv_cache_dtype)
        able = ("torch", "triton")  # both read and write int8 and fp8 (e4m3) caches
        if quant and self.backend.name not in able:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} is implemented by the "
                             f"{' and '.join(able)} attention backend(s) only, not "
                             f"{self.backend.name!r}; use {able[0]!r} or kv_cache_dtype='auto'")
        store = QUANT_KV[kv_cache_dtype] if quant else dtype
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        cpu_shape = (num_cpu_blocks, block_size, num_kv_heads, head_dim)
        n_cpu = num_layers if num_cpu_blocks else 0

        def make(shp: tuple, dt: torch.dtype, dev: torch.device | str, n: int) -> list:
            return [pool_zeros(shp, dt, dev) for _ in range(n)]

        dev_shapes = _layer_shapes(num_blocks, block_size, num_kv_heads, head_dim, latent)
        cpu_shapes = _layer_shapes(num_cpu_blocks, block_size, num_kv_heads, head_dim,
                                   latent)[:n_cpu]
        self.k_caches = [make(k, store, device, 1)[0] for k, _ in dev_shapes]
        self.v_caches = [make(v, store, device, 1)[0] for _, v in dev_shapes]
        self.cpu_k = [make(k, store, "cpu", 1)[0] for k, _ in cpu_shapes]
        self.cpu_v = [make(v, store, "cpu", 1)[0] for _, v in cpu_shapes]
        self.kv_latent_dims = latent
        n_scale = num_layers if quant else 0
        self.k_scales = make(shape[:3], KV_SCALE_DTYPE, device, n_scale)
        self.v_scales = make(shape[:3], KV_SCALE_DTYPE, device, n_scale)
        self.cpu_k_scales = make(cpu_shape[:3], KV_SCALE_DTYPE, "cpu", n_cpu if quant else 0)
        self.cpu_v_scales = make(cpu_shape[:3], KV_SCALE_DTYPE, "cpu", n_cpu if quant else 0)
        if layout is not None:
            self._share_tensors(layout)
        self.metas: list[AttentionMetadata] = []  # one per group (hybrid), else empty
        self.scale = head_dim ** -0.5
        self.block_size = block_size
        self.sliding_windows = _layer_windows(sliding_window, num_layers, self.backend.name)
        self.meta: AttentionMetadata | None = None

    def _share_tensors(self, layout: HybridLayout) -> None:
        """Layer j of every group writes into tensor j (:class:`labkit.kv.hybrid.
        HybridLayout`): a block id belongs to one group at a time, so they never collide."""
        for name in ("k_caches", "v_caches", "cpu_k", "cpu_v", "k_scales", "v_scales",
                     "cpu_k_scales", "cpu_v_scales"):
            ts = getattr(self, name)
            setattr(self, name, [ts[t] for t in layout.layer_tensor] if ts else ts)

    def nbytes(self) -> int:
        """Device bytes of the KV pool (values and, for INT8, scales; a tensor the groups
        share counted once)."""
        ts = {id(t): t for ts in (self.k_caches, self.v_caches, self.k_scales, self.v_scales)
              for t in ts}
        return sum(t.numel() * t.element_size() for t in ts.values())

    @classmethod
    def for_model(cls, model_config: object, cache: CacheConfig, dtype: torch.dtype,
                  device: torch.device | str, backend: AttentionBackend | None = None,
                  layout: HybridLayout | None = None) -> PagedKVCache:
        """The pool ``cache`` describes (its num_blocks resolved) for a model's shapes. A model
        with attention sinks (gpt-oss) needs a backend that has them (torch, triton): a backend
        without them is refused here, before a step."""
        c = model_config
        name = (backend or TorchBackend()).name
        if getattr(c, "attention_sinks", False) and name not in ("torch", "triton"):
            raise ValueError(f"attention sinks (gpt-oss) are implemented by the 'torch' and "
                             f"'triton' attention backends only, not {name!r}; use "
                             "attention_backend='torch'")
        return cls(c.num_hidden_layers, cache.num_blocks, cache.block_size,
                   c.num_key_value_heads, c.head_dim, dtype, device, backend,
                   cache.num_cpu_blocks, layer_sliding_windows(c), cache.kv_cache_dtype,
                   layer_kv_latent_dims(c), layout)

    def begin_step(self, slots: list[int], block_tables: list[list[int]], query_lens: list[int],
                   context_lens: list[int]) -> None:
        """Set the metadata every layer of the next forward reads (built once, not per layer)."""
        dev = self.k_caches[0].device
        self.meta = build_attention_metadata(slots, block_tables, query_lens, context_lens, dev)

    def begin_step_groups(self, slots: list[list[int]], block_tables: list[list[list[int]]],
                          query_lens: list[int], context_lens: list[int]) -> None:
        """:meth:`begin_step` with one slot mapping and set of block tables per group
        (hybrid): each layer then reads its group's metadata."""
        dev = self.k_caches[0].device
        self.metas = [build_attention_metadata(s, t, query_lens, context_lens, dev)
                      for s, t in zip(slots, block_tables)]
        self.meta = self.metas[0]

    def end_step(self) -> None:
        self.meta, self.metas = None, []

    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """The model's hook: store this layer's new K/V in their slots, attend over the cache.

        ``sinks`` [Hq] (a gpt-oss layer's sink logits, :mod:`labkit.model.sinks`) is the one
        per-layer value the layer hands over with its q/k/v: nothing is cached for it, the
        backend adds it to every softmax's denominator (the torch backend; Triton refuses)."""
        m = self.metas[self.layout.layer_group[layer_idx]] if self.metas else self.meta
        be = self.backend
        kc, vc = self.k_caches[layer_idx], self.v_caches[layer_idx]
        ks = self.k_scales[layer_idx] if self.k_scales else None
        vs = self.v_scales[layer_idx] if self.v_scales else None
        kw = {"k_scale": ks, "v_scale": vs, "meta": m}
        be.reshape_and_cache(k[0], v[0], kc, vc, m.slot_mapping, **kw)
        kw["sliding_window"] = self.sliding_windows[layer_idx]
        if sinks is not None:
            kw["sinks"] = sinks
        if m.decode_only:
            out = be.decode(q[0], kc, vc, m.block_tables, m.context_lens, self.scale, **kw)
        else:
            out = be.prefill(q[0], kc, vc, m.block_tables, m.query_start_loc, m.context_lens,
                             self.scale, **kw)
        return out[None]

    def attend_latent(self, layer_idx: int, q_nope: torch.Tensor, q_pe: torch.Tensor,
                      kv_latent: torch.Tensor, positions: torch.Tensor,
                      mla: torch.nn.Module) -> torch.Tensor:
        """A latent (MLA) layer's hook: store its new latents [1,N,latent_dim] in their slots,
        then attend (decodes absorbed, prefill chunks expanded: :mod:`labkit.kv.mla`)."""
        cache = self.k_caches[layer_idx]
        if self.kv_latent_dims[layer_idx] != kv_latent.shape[-1]:
            raise ValueError(f"layer {layer_idx} hands latents of width {kv_latent.shape[-1]} "
                             f"to a cache layer that holds {self.kv_latent_dims[layer_idx]} "
                             "(None: per-head K/V): build the cache with for_model")
        reshape_and_cache_latent(kv_latent[0], cache, self.meta.slot_mapping)
        decode = getattr(self.backend, "mla_decode", None)  # absorbed; the torch one if absent
        return mla_paged_attention(q_nope[0], q_pe[0], cache, self.meta, mla, decode)[None]

    # ---- block copies the block manager queued ------------------------------------------------
    def _device_lists(self) -> list[tuple[list, list]]:
        """(device tensors per layer, their CPU swap pool) for values and scales."""
        pairs = [(self.k_caches, self.cpu_k), (self.v_caches, self.cpu_v),
                 (self.k_scales, self.cpu_k_scales), (self.v_scales, self.cpu_v_scales)]
        if self.layout is None:
            return pairs
        first = sorted({self.layout.layer_tensor.index(t) for t in self.layout.layer_tensor})
        return [([d[i] for i in first] if d else d, [h[i] for i in first] if h else h)
                for d, h in pairs]  # shared tensors once each

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: dst <- src in every layer."""
        if not pairs:
            return
        dev = self.k_caches[0].device
        src = torch.tensor([s for s, _ in pairs], device=dev)
        dst = torch.tensor([d for _, d in pairs], device=dev)
        for tensors, _ in self._device_lists():
            for t in tensors:
                t[dst] = t[src]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """(gpu block, cpu block): copy to host memory."""
        if not pairs:
            return
        g = torch.tensor([a for a, _ in pairs], device=self.k_caches[0].device)
        c = torch.tensor([b for _, b in pairs])
        for dev_ts, cpu_ts in self._device_lists():
            for d, h in zip(dev_ts, cpu_ts):
                h[c] = d[g].cpu()

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """(cpu block, gpu block): copy back to device memory."""
        if not pairs:
            return
        dev = self.k_caches[0].device
        c = torch.tensor([a for a, _ in pairs])
        g = torch.tensor([b for _, b in pairs], device=dev)
        for dev_ts, cpu_ts in self._device_lists():
            for d, h in zip(dev_ts, cpu_ts):
                d[g] = h[c].to(dev)

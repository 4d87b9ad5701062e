"""What the paged attention kernels (decode and prefill) share on the host side: the input checks
that stand between a wrong shape and a raw pointer read, and the references' small pieces (one
sequence's K/V gathered in order, a softmax with gpt-oss's sink column)."""

from __future__ import annotations

import torch
from labkit.kernels._common import FLOAT_DTYPES, INDEX_DTYPES, check, check_dtype, on_host
from labkit.kernels.int8_kv import check_kv_scales

from labkit.kv.ops import gather_blocks


def check_paged_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_tables: torch.Tensor, context_lens: torch.Tensor,
                       k_scale: torch.Tensor | None = None,
                       v_scale: torch.Tensor | None = None,
                       sinks: torch.Tensor | None = None) -> bool:
    """ValueError for inputs the kernels would misread; returns True for an INT8/FP8 cache."""
    check(k_cache.dim() == 4 and k_cache.shape == v_cache.shape,
          f"k_cache/v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim], "
          f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    check(q.shape[-1] == k_cache.shape[3],
          f"q head_dim {q.shape[-1]} != cache head_dim {k_cache.shape[3]}")
    check(q.shape[-2] % k_cache.shape[2] == 0,
          f"num query heads {q.shape[-2]} must be a multiple of num kv heads {k_cache.shape[2]}")
    check_dtype(q, "q (and the caches)", FLOAT_DTYPES)
    quant = check_kv_scales(k_cache, v_cache, k_scale, v_scale)
    check(quant or q.dtype == k_cache.dtype == v_cache.dtype,
          f"q, k_cache, v_cache dtypes differ: {q.dtype}, {k_cache.dtype}, {v_cache.dtype}")
    check(q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1,
          "q, k_cache and v_cache need a contiguous last (head_dim) dimension")
    check(block_tables.dim() == 2 and block_tables.dtype in INDEX_DTYPES,
          "block_tables must be a 2-D int32 tensor [num_seqs, max_blocks]")
    check(context_lens.dim() == 1 and context_lens.numel() == block_tables.shape[0],
          "context_lens must be 1-D with one entry per block_tables row")
    check_dtype(context_lens, "context_lens", INDEX_DTYPES)
    check(len({t.device for t in (q, k_cache, v_cache, block_tables, context_lens)}) == 1,
          "q, the caches, block_tables and context_lens must be on one device")
    if sinks is not None:  # one sink logit per query head (labkit.model.sinks)
        check(sinks.dim() == 1 and sinks.numel() == q.shape[-2],
              f"sinks must be [num_q_heads] = [{q.shape[-2]}], got {tuple(sinks.shape)}")
        check_dtype(sinks, "sinks", FLOAT_DTYPES)
        check(sinks.device == q.device, f"sinks must be on q's device {q.device}")
    return quant


def check_context_lens(block_tables: torch.Tensor, context_lens: torch.Tensor,
                       k_cache: torch.Tensor, min_len: int) -> None:
    """On CPU tensors (see ``on_host``): every context fits its block-table row and the blocks
    it uses exist. Out-of-range values would read outside the caches."""
    if not on_host(block_tables, context_lens) or context_lens.numel() == 0:
        return
    num_blocks, block_size = k_cache.shape[0], k_cache.shape[1]
    lens = context_lens.long()
    check(int(lens.min()) >= min_len, f"every context_lens entry must be >= {min_len}, got "
          f"{int(lens.min())}")
    capacity = block_tables.shape[1] * block_size
    check(int(lens.max()) <= capacity,
          f"context_lens has {int(lens.max())} tokens but block_tables rows hold only "
          f"{block_tables.shape[1]} blocks x {block_size} = {capacity}")
    used = torch.arange(block_tables.shape[1])[None, :] < (lens[:, None] + block_size - 1) \
        // block_size
    ids = block_tables[used]
    check(ids.numel() == 0 or (int(ids.min()) >= 0 and int(ids.max()) < num_blocks),
          f"block_tables name physical blocks outside the cache's {num_blocks}")


def softmax_with_sinks(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim of scores [H, ..., T]; with sinks [H], each row's softmax of
    [scores | sink] without the sink's column (the references' one spelling of a sink)."""
    if sinks is None:
        return scores.softmax(-1)
    sink = sinks.float().view(-1, *[1] * (scores.dim() - 1)).expand(*scores.shape[:-1], 1)
    return torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]


def check_window(sliding_window: int | None) -> None:
    check(sliding_window is None or (isinstance(sliding_window, int) and sliding_window >= 1),
          f"sliding_window must be None or a positive int, got {sliding_window!r}")


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first ``length`` tokens of one sequence from a paged cache, as [length, Hkv, D]
    (labkit's one block gather, :func:`labkit.kv.ops.gather_blocks`)."""
    n_blocks = (length + cache.shape[1] - 1) // cache.shape[1]
    return gather_blocks(cache, block_table[:n_blocks])[:length]

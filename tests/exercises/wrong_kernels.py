"""Wrong Triton kernels (negative controls): each a classic kernel bug the checker must catch.

Imported after conftest.py has called ``ensure_interpreter()``: the decorators below need it."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add_kernel_no_mask(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    """Forgets the tail mask: the last program reads and writes past the end."""
    offsets = tl.program_id(0) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets) + tl.load(y_ptr + offsets))


@triton.jit
def add_kernel_wrong_offset(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    """Every program computes the first block: offsets forget pid * BLOCK_SIZE."""
    offsets = tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + tl.load(y_ptr + offsets, mask=mask), mask=mask)


@triton.jit
def paged_ignores_block_table(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                              context_lens_ptr, out_ptr, scale, max_blocks_per_seq,
                              BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Treats the cache as contiguous per sequence: logical block i = physical block i."""
    seq = tl.program_id(0)
    context_len = tl.load(context_lens_ptr + seq)
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + seq * HEAD_DIM + d).to(tl.float32)
    m = tl.max(tl.full([BLOCK_SIZE], float("-inf"), tl.float32), axis=0)
    denom = tl.sum(tl.zeros([BLOCK_SIZE], tl.float32), axis=0)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for i in range(0, tl.cdiv(context_len, BLOCK_SIZE)):
        block = (seq * max_blocks_per_seq + i).to(tl.int64)
        valid = i * BLOCK_SIZE + t < context_len
        offs = block * BLOCK_SIZE * HEAD_DIM + t[:, None] * HEAD_DIM + d[None, :]
        k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.where(valid, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        correction = tl.exp(m - m_new)
        p = tl.exp(scores - m_new)
        v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        denom = denom * correction + tl.sum(p, axis=0)
        acc = acc * correction + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    tl.store(out_ptr + seq * HEAD_DIM + d, acc / denom)


@triton.jit
def paged_no_context_mask(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                          out_ptr, scale, max_blocks_per_seq,
                          BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Attends to every slot of the last block, including those past context_len."""
    seq = tl.program_id(0)
    context_len = tl.load(context_lens_ptr + seq)
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + seq * HEAD_DIM + d).to(tl.float32)
    m = tl.max(tl.full([BLOCK_SIZE], float("-inf"), tl.float32), axis=0)
    denom = tl.sum(tl.zeros([BLOCK_SIZE], tl.float32), axis=0)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for i in range(0, tl.cdiv(context_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * max_blocks_per_seq + i).to(tl.int64)
        offs = block * BLOCK_SIZE * HEAD_DIM + t[:, None] * HEAD_DIM + d[None, :]
        k = tl.load(k_cache_ptr + offs).to(tl.float32)
        scores = tl.sum(k * q[None, :], axis=1) * scale
        m_new = tl.maximum(m, tl.max(scores, axis=0))
        correction = tl.exp(m - m_new)
        p = tl.exp(scores - m_new)
        v = tl.load(v_cache_ptr + offs).to(tl.float32)
        denom = denom * correction + tl.sum(p, axis=0)
        acc = acc * correction + tl.sum(p[:, None] * v, axis=0)
        m = m_new
    tl.store(out_ptr + seq * HEAD_DIM + d, acc / denom)


@triton.jit
def paged_no_rescale(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                     out_ptr, scale, max_blocks_per_seq,
                     BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Online softmax that forgets to rescale the running sum and accumulator when the max
    grows: right for one block, wrong as soon as a later block holds a larger score."""
    seq = tl.program_id(0)
    context_len = tl.load(context_lens_ptr + seq)
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + seq * HEAD_DIM + d).to(tl.float32)
    m = tl.max(tl.full([BLOCK_SIZE], float("-inf"), tl.float32), axis=0)
    denom = tl.sum(tl.zeros([BLOCK_SIZE], tl.float32), axis=0)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for i in range(0, tl.cdiv(context_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * max_blocks_per_seq + i).to(tl.int64)
        valid = i * BLOCK_SIZE + t < context_len
        offs = block * BLOCK_SIZE * HEAD_DIM + t[:, None] * HEAD_DIM + d[None, :]
        k = tl.load(k_cache_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        scores = tl.where(valid, tl.sum(k * q[None, :], axis=1) * scale, float("-inf"))
        m = tl.maximum(m, tl.max(scores, axis=0))
        p = tl.exp(scores - m)
        v = tl.load(v_cache_ptr + offs, mask=valid[:, None], other=0.0).to(tl.float32)
        denom = denom + tl.sum(p, axis=0)
        acc = acc + tl.sum(p[:, None] * v, axis=0)
    tl.store(out_ptr + seq * HEAD_DIM + d, acc / denom)

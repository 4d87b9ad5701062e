"""Reference Triton kernels for the exercises (spoilers), read through ``solutions``.

``solutions`` calls ``triton_kernels.ensure_interpreter()`` before importing this module: the
``@triton.jit`` decorators below decide between the CPU interpreter and a GPU when they run.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
    pid = tl.program_id(0)
    offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offsets < n_elements
    x = tl.load(x_ptr + offsets, mask=mask)
    y = tl.load(y_ptr + offsets, mask=mask)
    tl.store(out_ptr + offsets, x + y, mask=mask)


@triton.jit
def paged_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
                           out_ptr, scale, max_blocks_per_seq,
                           BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
    seq = tl.program_id(0)
    context_len = tl.load(context_lens_ptr + seq)
    d = tl.arange(0, HEAD_DIM)
    t = tl.arange(0, BLOCK_SIZE)
    q = tl.load(q_ptr + seq * HEAD_DIM + d).to(tl.float32)
    # running max, running sum of exp, and the unnormalised output (online softmax)
    m = tl.max(tl.full([BLOCK_SIZE], float("-inf"), tl.float32), axis=0)
    denom = tl.sum(tl.zeros([BLOCK_SIZE], tl.float32), axis=0)
    acc = tl.zeros([HEAD_DIM], tl.float32)
    for i in range(0, tl.cdiv(context_len, BLOCK_SIZE)):
        block = tl.load(block_tables_ptr + seq * max_blocks_per_seq + i).to(tl.int64)
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

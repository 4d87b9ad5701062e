"""Paged decode attention for the CPU: a C++ kernel, built and loaded the way inductor builds
its own, so a compiled decode graph can call it as one op (as vLLM's CPU backend and llama.cpp
run hand-written attention beside compiler-generated layers).

Why a hand-written kernel: written as products and sums over the gathered blocks
(:func:`labkit.engine.full_graph.paged_decode_attention`), inductor fuses attention into loops
that are correct but slow. They run over every key of the padded block bucket, reduce each
score across a vector in a separate pass, and take the softmax over a dimension that is not
innermost. On labkit-tiny at batch 32 that is about 0.4 ms per layer, more than the layer's
four matmuls. This kernel reads each sequence's own keys once (``context_lens``, not the bucket)
and takes 0.08 ms (``labkit bench step`` measures what it buys end to end).

Loop nest, one iteration per (sequence, kv head), the G = Hq/Hkv query heads that share the
kv head riding along, as in the Triton kernel (:mod:`labkit.kernels.paged_attention`)::

    for s in window .. context:                    K row s: block_tables[b, s // bs], s % bs
        load K row once (D/W vectors)  -> G dot products  -> scores[g, s]   (W: vector width)
    softmax of each scores[g, :]                  (exact two-pass, no online rescaling)
    for s in window .. context:
        load V row once                -> acc[g, :] += p[g, s] * V row      (G x D/W registers)

What bounds it: the K/V reads, 2 * D * 4 bytes per (token, kv head) for 4 * G * D FLOPs, and
one horizontal vector sum per score. The vectors are ATen's ``at::vec::Vectorized<float>``
(AVX-512, AVX2 or plain C++, whichever inductor picked for this CPU), so the same source runs on
every x86 machine. The shapes (G, D, Hkv, block size) and the thread count are compiled in, as
inductor compiles in its kernels' sizes; each combination is built once per process (and cached
on disk by inductor). float32 caches only: other dtypes keep inductor's loops.

``paged_decode_cpu`` checks its inputs (a wrong block id would read outside the pool);
``labkit::paged_decode_cpu``, the op the compiled graph calls, trusts the engine's own tables.
The reference is :func:`labkit.kernels.paged_attention.paged_attention_decode_ref`.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import torch
from labkit.kernels._common import check
from labkit.kernels.paged_checks import check_context_lens, check_paged_inputs, check_window

VECTOR_MULTIPLE = 16  # head_dim must be a multiple of every vector width (AVX-512: 16 floats)

_SOURCE = r"""
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>
using Vec = at::vec::Vectorized<float>;
constexpr int64_t G = %(G)d, D = %(D)d, HKV = %(HKV)d, HQ = G * HKV, BS = %(BS)d;
constexpr int64_t NV = D / Vec::size();
static_assert(D %% Vec::size() == 0, "head_dim must be a multiple of the vector width");

static void scores(const float* q, const float* kc, const int64_t* row, int64_t h,
                   int64_t lo, int64_t n, float scale, float* sc) {
    Vec qv[G][NV];
    for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < NV; ++j) qv[g][j] = Vec::loadu(q + g * D + j * Vec::size());
    for (int64_t s = lo; s < n; ++s) {
        const float* kp = kc + ((row[s / BS] * BS + s %% BS) * HKV + h) * D;
        Vec kv[NV];
        for (int64_t j = 0; j < NV; ++j) kv[j] = Vec::loadu(kp + j * Vec::size());
        for (int64_t g = 0; g < G; ++g) {
            Vec acc = qv[g][0] * kv[0];
            for (int64_t j = 1; j < NV; ++j) acc = at::vec::fmadd(qv[g][j], kv[j], acc);
            sc[g * (n - lo) + s - lo] = scale * at::vec::vec_reduce_all<float>(
                [](Vec& x, Vec& y) { return x + y; }, acc);
        }
    }
}

static void softmax_rows(float* sc, int64_t len) {
    for (int64_t g = 0; g < G; ++g) {
        float* p = sc + g * len;
        float m = -std::numeric_limits<float>::infinity(), sum = 0.f;
        for (int64_t i = 0; i < len; ++i) m = std::max(m, p[i]);
        for (int64_t i = 0; i < len; ++i) { p[i] = std::exp(p[i] - m); sum += p[i]; }
        for (int64_t i = 0; i < len; ++i) p[i] /= sum;
    }
}

static void weighted_values(const float* sc, const float* vc, const int64_t* row, int64_t h,
                            int64_t lo, int64_t n, float* out) {
    Vec acc[G][NV];
    for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < NV; ++j) acc[g][j] = Vec(0.f);
    for (int64_t s = lo; s < n; ++s) {
        const float* vp = vc + ((row[s / BS] * BS + s %% BS) * HKV + h) * D;
        Vec vv[NV];
        for (int64_t j = 0; j < NV; ++j) vv[j] = Vec::loadu(vp + j * Vec::size());
        for (int64_t g = 0; g < G; ++g) {
            const Vec p(sc[g * (n - lo) + s - lo]);
            for (int64_t j = 0; j < NV; ++j) acc[g][j] = at::vec::fmadd(p, vv[j], acc[g][j]);
        }
    }
    for (int64_t g = 0; g < G; ++g)
        for (int64_t j = 0; j < NV; ++j) acc[g][j].store(out + g * D + j * Vec::size());
}

void kernel(const float* q, const float* kc, const float* vc, const int64_t* tables,
            const int64_t* ctx, float* out, int64_t B, int64_t width, int64_t window,
            float scale) {
    %(OMP)s
    for (int64_t bh = 0; bh < B * HKV; ++bh) {
        const int64_t b = bh / HKV, h = bh %% HKV, n = ctx[b];
        const int64_t lo = window > 0 ? std::max<int64_t>(0, n - window) : 0;
        thread_local std::vector<float> sc;
        sc.resize(G * (n - lo));
        const int64_t* row = tables + b * width;
        const int64_t first = (b * HQ + h * G) * D;  // this kv head's first query head
        scores(q + first, kc, row, h, lo, n, scale, sc.data());
        softmax_rows(sc.data(), n - lo);
        weighted_values(sc.data(), vc, row, h, lo, n, out + first);
    }
}
"""

_ARGTYPES = ["const float*", "const float*", "const float*", "const int64_t*", "const int64_t*",
             "float*", "int64_t", "int64_t", "int64_t", "float"]


@cache
def build(group: int, head_dim: int, num_kv_heads: int, block_size: int,
          threads: int) -> Callable[..., None]:
    """The compiled kernel for these shapes and thread count (inductor's C++ code cache: a
    C++ compiler is needed, as for ``LLM(compile=True)`` itself)."""
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    omp = f"#pragma omp parallel for num_threads({threads})" if threads > 1 else ""
    src = _SOURCE % {"G": group, "D": head_dim, "HKV": num_kv_heads, "BS": block_size,
                     "OMP": omp}
    return CppPythonBindingsCodeCache.load_pybinding(_ARGTYPES, src)


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> str | None:
    """Why this kernel cannot run these tensors (None: it can)."""
    if q.device.type != "cpu" or k_cache.device.type != "cpu":
        return "the C++ decode kernel runs on CPU tensors"
    if q.dtype != torch.float32 or k_cache.dtype != torch.float32:
        return f"the C++ decode kernel reads float32 caches, not {k_cache.dtype}"
    if q.shape[-1] % VECTOR_MULTIPLE:
        return f"head_dim {q.shape[-1]} is not a multiple of {VECTOR_MULTIPLE}"
    return None


def _run(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
         block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
         window: int) -> torch.Tensor:
    """No checks: contiguous float32 q [B, Hq, D], caches [blocks, bs, Hkv, D], int64 tables
    [B, W] and lengths [B] that fit them (the engine's own)."""
    _, block_size, num_kv_heads, head_dim = k_cache.shape
    fn = build(q.shape[1] // num_kv_heads, head_dim, num_kv_heads, block_size,
               torch.get_num_threads())
    out = torch.empty_like(q)
    fn(q, k_cache, v_cache, block_tables, context_lens, out, q.shape[0], block_tables.shape[1],
       window, scale)
    return out


@torch.library.custom_op("labkit::paged_decode_cpu", mutates_args=())
def paged_decode_op(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                    window: int) -> torch.Tensor:
    """The op a compiled graph calls (opaque to inductor, which calls it between its loops)."""
    return _run(q.contiguous(), k_cache, v_cache, block_tables.contiguous(),
                context_lens.contiguous(), scale, window)


@paged_decode_op.register_fake
def _(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
      context_lens: torch.Tensor, scale: float, window: int) -> torch.Tensor:
    return torch.empty_like(q, memory_format=torch.contiguous_format)


def paged_decode_cpu(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                     sliding_window: int | None = None) -> torch.Tensor:
    """Decode attention over a paged float32 KV cache on the CPU: q [B, Hq, D] -> [B, Hq, D].
    Checks the inputs as the Triton kernel does (ValueError), then runs the C++ kernel."""
    check_window(sliding_window)
    check_paged_inputs(q, k_cache, v_cache, block_tables, context_lens)
    check(q.dim() == 3 and q.shape[0] == block_tables.shape[0],
          f"q must be [num_seqs, num_q_heads, head_dim] with one row per block-table row, got "
          f"{tuple(q.shape)} for {block_tables.shape[0]} rows")
    reason = supports(q, k_cache)
    check(reason is None, str(reason))
    check_context_lens(block_tables, context_lens, k_cache, min_len=1)
    return _run(q.contiguous(), k_cache, v_cache, block_tables.long().contiguous(),
                context_lens.long().contiguous(), scale, sliding_window or 0)

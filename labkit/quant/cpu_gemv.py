"""A prefetching INT8 weight-only GEMV for batch-1 CPU decode, in C, compiled on first use.

Why it exists: torch's ``_weight_int8pack_mm`` reads int8 weights fast *from cache* (about
11 G weights/s on one core) but slowly from memory: on a 116 M-parameter model it streamed
~4 GB/s, while fp32's sgemv (oneDNN/MKL, which prefetch in software) streamed ~10-13 GB/s. So
INT8 moved 4x fewer bytes but at a third of the rate, and decode was only ~1.4x faster than
fp32. A decode GEMV reads every weight byte once: what decides its speed is how many cache
misses are in flight, not arithmetic. This kernel asks for the bytes ``_PREFETCH`` ahead of
where it reads (``_mm_prefetch``), four output rows at a time, and converts int8 -> fp32 in
registers (AVX-512 or AVX2 + FMA). Activations, scales and the accumulation stay fp32, so it is
also *more* exact than the bf16-activation torch path (tests/quant/test_cpu_gemv.py).

It is an optional accelerator: built with the system C compiler (``cc``, ``-O3
-march=native``) into ``~/.cache/labkit`` the first time an INT8 layer decodes on CPU, loaded
with ctypes (which releases the GIL during the call). No compiler, a CPU without AVX2, or
``LABKIT_CPU_GEMV=0``: :func:`library` returns None and INT8 layers use torch's kernel, with the
same results within its bf16 tolerance. Single-threaded by design (the benchmarks use one
thread); prefill (many rows) goes to torch's kernel, which is compute-bound there anyway.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

MAX_ROWS = 8  # more rows than this (prefill) -> torch's kernel
_PREFETCH = 16384  # bytes ahead of each row pointer: ~4 row blocks at K = 1024

_SOURCE = r"""
#include <stdint.h>
#include <immintrin.h>
#ifndef PF
#define PF 16384
#endif
#if defined(__AVX512F__)
#define W 16
typedef __m512 vf;
static inline vf ld_w(const int8_t *p) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
#define LD_X(p) _mm512_loadu_ps(p)
#define FMA(a, b, c) _mm512_fmadd_ps(a, b, c)
#define ZERO() _mm512_setzero_ps()
static inline float hsum(vf v) { return _mm512_reduce_add_ps(v); }
#elif defined(__AVX2__) && defined(__FMA__)
#define W 8
typedef __m256 vf;
static inline vf ld_w(const int8_t *p) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}
#define LD_X(p) _mm256_loadu_ps(p)
#define FMA(a, b, c) _mm256_fmadd_ps(a, b, c)
#define ZERO() _mm256_setzero_ps()
static inline float hsum(vf v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_shuffle_ps(s, s, 1)));
}
#else
#error "needs AVX-512 or AVX2+FMA"
#endif

/* y[m*N + n] = s[n] * sum_k x[m*K + k] * w[n*K + k]   (rows of 4, then single rows) */
void labkit_int8_gemv(const float *x, const int8_t *w, const float *s, float *y,
                      int64_t M, int64_t N, int64_t K) {
    const int64_t kv = K / W * W;
    int64_t n = 0;
    for (; n + 4 <= N; n += 4) {
        const int8_t *r[4] = {w + n * K, w + (n + 1) * K, w + (n + 2) * K, w + (n + 3) * K};
        for (int64_t m = 0; m < M; m++) {
            const float *xm = x + m * K;
            vf a0 = ZERO(), a1 = ZERO(), a2 = ZERO(), a3 = ZERO();
            for (int64_t k = 0; k < kv; k += W) {
                if (m == 0 && (k & 63) == 0)
                    for (int i = 0; i < 4; i++)
                        _mm_prefetch((const char *)(r[i] + k + PF), _MM_HINT_T0);
                vf xv = LD_X(xm + k);
                a0 = FMA(xv, ld_w(r[0] + k), a0);
                a1 = FMA(xv, ld_w(r[1] + k), a1);
                a2 = FMA(xv, ld_w(r[2] + k), a2);
                a3 = FMA(xv, ld_w(r[3] + k), a3);
            }
            float t[4] = {hsum(a0), hsum(a1), hsum(a2), hsum(a3)};
            for (int64_t k = kv; k < K; k++)
                for (int i = 0; i < 4; i++) t[i] += xm[k] * (float)r[i][k];
            for (int i = 0; i < 4; i++) y[m * N + n + i] = t[i] * s[n + i];
        }
    }
    for (; n < N; n++) {
        const int8_t *r = w + n * K;
        for (int64_t m = 0; m < M; m++) {
            float t = 0.0f;
            for (int64_t k = 0; k < K; k++) t += x[m * K + k] * (float)r[k];
            y[m * N + n] = t * s[n];
        }
    }
}
"""

_STATE: dict[str, object] = {}


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "labkit"


def _compile(out: Path) -> bool:
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which(
        "clang")
    if cc is None:
        return False
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src, lib = Path(tmp) / "gemv.c", Path(tmp) / out.name
        src.write_text(_SOURCE)
        cmd = [cc, "-O3", "-march=native", f"-DPF={_PREFETCH}", "-shared", "-fPIC", str(src),
               "-o", str(lib)]
        try:
            ok = subprocess.run(cmd, capture_output=True, timeout=120).returncode == 0
        except (OSError, subprocess.SubprocessError):
            return False
        if ok:
            os.replace(lib, out)  # atomic: a concurrent process never loads half a file
        return ok


def library() -> ctypes.CDLL | None:
    """The compiled kernel, or None where it cannot be built here (then use torch's)."""
    if "lib" in _STATE:
        return _STATE["lib"]  # type: ignore[return-value]
    lib = None
    if os.environ.get("LABKIT_CPU_GEMV", "1") != "0" and platform.machine().lower() in (
            "x86_64", "amd64"):
        key = hashlib.sha256(f"{_SOURCE}{_PREFETCH}{platform.node()}".encode()).hexdigest()[:16]
        path = _cache_dir() / f"int8_gemv_{key}.so"
        try:
            if path.exists() or _compile(path):
                lib = ctypes.CDLL(str(path))
                lib.labkit_int8_gemv.restype = None
                lib.labkit_int8_gemv.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3
        except OSError:
            lib = None
    _STATE["lib"] = lib
    return lib


def int8_gemv(x2d: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
              lib: ctypes.CDLL) -> torch.Tensor:
    """``x2d @ (qweight * scales[:, None]).T`` for fp32 ``x2d`` [M, K], int8 ``qweight``
    [N, K] and fp32 ``scales`` [N] (both contiguous, checked when packed)."""
    x = x2d.contiguous()
    m, k = x.shape
    n = qweight.shape[0]
    if k != qweight.shape[1]:
        raise ValueError(f"input has {k} features, the weight {qweight.shape[1]}")
    y = torch.empty(m, n, dtype=torch.float32)
    lib.labkit_int8_gemv(x.data_ptr(), qweight.data_ptr(), scales.data_ptr(), y.data_ptr(),
                         m, n, k)
    return y

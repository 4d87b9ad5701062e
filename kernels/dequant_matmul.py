"""Weight-only quantized matmul: y = x @ W with W stored as 4-bit (GPTQ, AWQ) or 8-bit integers.

Decode is a matrix-vector product (M = batch of tokens is small), so time is the weight bytes
read. Storing W in 4 bits reads 4x fewer bytes than fp16; dequantising inside the matmul (never
materialising W in fp16) is what turns that into speed.

Tiling (program (n, m, k-split) owns output tile [BLOCK_M, BLOCK_N]; K is walked in BLOCK_K
steps, every SPLIT_K-th step by this program; split partials are summed by a second pass)::

    GPTQ qweight [K/8, N] int32           AWQ qweight [K, N/8] int32
    ┌────────┐ one int32 = 8 rows of K      ┌──┬──┐ one int32 = 8 columns of N,
    │ ▓▓▓▓▓▓ │ ─► [BLOCK_K/8, 8, BLOCK_N]   │▓▓│  │ nibble order 0 2 4 6 1 3 5 7
    └────────┘    ─► [BLOCK_K, BLOCK_N]     └──┴──┘ ─► [BLOCK_K, BLOCK_N/8, 8] ─► [BLOCK_K, BLOCK_N]
             w = (q - zero) * scale[group]   then   acc += x_tile @ w   (tensor cores, fp32 acc)

M = 1 (one decode token) goes to the GEMV kernels in ``dequant_gemv.py``: no tensor cores (a
single row would be padded to 16 for ``tl.dot``), an FMA per weight, zero and scale factored out
of the inner loop. The config key BLOCK_M = 1 selects them.

What bounds it: for small M, memory. FLOPs 2*M*K*N over bytes K*N/2 (4-bit): intensity 4*M
FLOP/byte, so up to M ~ 50 the H200 (ridge ~200 FLOP/byte) waits on weights; larger M turns
compute-bound and the in-loop dequantisation (here ~4 instructions per weight: and-or into a
float's mantissa, subtract zero, scale, convert for the dot; see ``_nibbles_as_floats``) becomes
overhead against a plain fp16 GEMM. A plain int->float conversion per weight (quarter rate)
would cost more.

Layouts (see interfaces.md):
- GPTQ: qweight int32 [K/8, N] (lowest nibble = first row); qzeros int32 [G, N/8] storing zero-1,
  packed along N the same way; scales fp16 [G, N]; g_idx int32 [K]. W = (q - (z + 1)) * s.
- AWQ GEMM: qweight int32 [K, N/8], nibble j holds column AWQ_ORDER[j]; qzeros int32 [G, N/8]
  the same way, raw zeros; scales [G, N]; group = k // group_size. W = (q - z) * s.
- W8A16: int8 weight [N, K], per-output-channel scale [N]. W = q * s (as [K, N]: transposed).
NF4 dequantisation (bitsandbytes layout) lives in ``nf4.py``.
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl
from labkit.kernels._common import FLOAT_DTYPES, INDEX_DTYPES, check, check_dtype, interpreting
from labkit.kernels.dequant_gemv import KERNELS as GEMV_KERNELS
from labkit.kernels.dequant_gemv import gemv_config

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
MAGIC = tl.constexpr(8388608.0)  # 2^23: OR-ing a small int into the mantissa gives 2^23 + int


@triton.jit
def _as_magic_float(q):
    """int32 codes 0..15 -> the fp32 value 2^23 + q by bit pattern (0x4B000000 | q).

    Int-to-float conversion runs at a quarter of the FMA rate or less; the bit trick is one
    logic op, and subtracting 2^23 (+ the zero point) afterwards is exact."""
    return (q | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _nibbles_as_floats(words, nib):
    """Nibble ``nib`` (0..7, a tensor broadcastable against ``words``) of int32 ``words`` as the
    fp32 value 2^23 + q * 16^(nib % 4), with one logic op per element.

    Int-to-float conversion runs at a quarter of the FMA rate or less. Instead, the nibble is
    masked in place (within its 16-bit half: the high half is shifted down once per word) and
    OR-ed into the mantissa of 2^23; subtracting 2^23 + z * 16^(nib % 4) is then exact, and the
    power of 16 is folded into the scale. Four instructions per weight: and-or, sub, mul, fma.
    """
    half = tl.where(nib >= 4, words >> 16, words)  # one shift per word, shared by 4 nibbles
    mask = 0xF << ((nib % 4) * 4)
    return ((half & mask) | 0x4B000000).to(tl.float32, bitcast=True)


@triton.jit
def _pow16(nib):
    """16^(nib % 4) as fp32 (exact)."""
    return (1 << ((nib % 4) * 4)).to(tl.float32)


@triton.jit
def _dot_accumulate(acc, x_ptr, stride_xm, offs_m, offs_k, M, K, w, DOT_FP32: tl.constexpr):
    """acc[BLOCK_M, BLOCK_N] += x[offs_m, offs_k] @ w[BLOCK_K, BLOCK_N] on the tensor cores."""
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                mask=(offs_m[:, None] < M) & (offs_k[None, :] < K), other=0.0)
    if DOT_FP32 or x.dtype == tl.float32:  # interpreter, or an fp32 model: exact fp32 dot
        return acc + tl.dot(x.to(tl.float32), w.to(tl.float32), input_precision="ieee")
    return acc + tl.dot(x, w.to(x.dtype))


@triton.jit
def _write(out_ptr, offs, y, mask, split_stride, SPLIT: tl.constexpr):
    """Store the tile; with split-K, as this split's fp32 partial (summed by _sum_splits:
    one small deterministic pass instead of atomics on a zeroed buffer plus a cast)."""
    if SPLIT:
        tl.store(out_ptr + tl.program_id(2).to(tl.int64) * split_stride + offs, y, mask=mask)
    else:
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sum_splits(out_ptr, ws_ptr, numel, split_k, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    total = tl.zeros([BLOCK], tl.float32)
    for s in range(split_k):
        total += tl.load(ws_ptr + s * numel + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, total.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gptq_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, g_ptr, out_ptr, M, N, K, split_k, stride_xm, stride_om,
    split_stride,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
):
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows8 = tl.arange(0, BLOCK_K // 8)
    nib = tl.arange(0, 8)  # row k0 + 8i + j of a tile is nibble j of packed row i
    pow16 = _pow16(nib)
    inv16 = 1.0 / pow16
    z_shift = (offs_n % 8) * 4
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(tl.program_id(2) * BLOCK_K, K, BLOCK_K * split_k):
        offs_kp = k0 // 8 + rows8
        qw = tl.load(qw_ptr + offs_kp[:, None] * N + offs_n[None, :],
                     mask=(offs_kp[:, None] < K // 8) & n_mask[None, :], other=0)
        # [BK/8, 8, BN]: row k0 + 8i + j as the float 2^23 + q * 16^(j % 4)
        q = _nibbles_as_floats(qw[:, None, :], nib[None, :, None])
        if GROUP_SIZE > 0:  # g_idx == k // GROUP_SIZE and BLOCK_K divides it: one group
            g = k0 // GROUP_SIZE
            s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0)
            qz = tl.load(qz_ptr + g * (N // 8) + offs_n // 8, mask=n_mask, other=0)
            z = ((qz >> z_shift) & 0xF).to(tl.float32) + 1.0  # [BN], stored as zero - 1
            zz = MAGIC + z[None, :] * pow16[:, None]  # [8, BN]: per tile, not per weight
            sj = s.to(tl.float32)[None, :] * inv16[:, None]
            w = (q - zz[None, :, :]) * sj[None, :, :]
        else:  # act-order: every row of the tile may belong to another group
            offs_k2 = k0 + 8 * rows8[:, None] + nib[None, :]
            g = tl.load(g_ptr + offs_k2, mask=offs_k2 < K, other=0)[:, :, None]
            s = tl.load(s_ptr + g * N + offs_n[None, None, :], mask=n_mask[None, None, :],
                        other=0.0)
            qz = tl.load(qz_ptr + g * (N // 8) + (offs_n // 8)[None, None, :],
                         mask=n_mask[None, None, :], other=0)
            z = ((qz >> z_shift[None, None, :]) & 0xF).to(tl.float32) + 1.0
            p16 = pow16[None, :, None]
            w = (q - (MAGIC + z * p16)) * (s.to(tl.float32) * inv16[None, :, None])
        acc = _dot_accumulate(acc, x_ptr, stride_xm, offs_m, k0 + tl.arange(0, BLOCK_K), M, K,
                              tl.reshape(w.to(s_ptr.dtype.element_ty), [BLOCK_K, BLOCK_N]),
                              DOT_FP32)
    _write(out_ptr, offs_m[:, None] * stride_om + offs_n[None, :], acc,
           (offs_m[:, None] < M) & n_mask[None, :], split_stride, SPLIT)


@triton.jit
def _awq_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, out_ptr, M, N, K, split_k, stride_xm, stride_om,
    split_stride,
    GROUP_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
):
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_np = tl.program_id(0) * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)
    col = tl.arange(0, 8)
    offs_n2 = offs_np[:, None] * 8 + col[None, :]  # [BN/8, 8]: output column 8p + c
    np_mask = offs_np < N // 8
    shifts = ((col % 2) * 4 + col // 2) * 4  # column c sits in nibble AWQ_ORDER.index(c)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(tl.program_id(2) * BLOCK_K, K, BLOCK_K * split_k):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        qw = tl.load(qw_ptr + offs_k[:, None] * (N // 8) + offs_np[None, :],
                     mask=(offs_k[:, None] < K) & np_mask[None, :], other=0)
        q = _as_magic_float((qw[:, :, None] >> shifts[None, None, :]) & 0xF)  # [BK, BN/8, 8]
        g = k0 // GROUP_SIZE
        qz = tl.load(qz_ptr + g * (N // 8) + offs_np, mask=np_mask, other=0)
        z = ((qz[:, None] >> shifts[None, :]) & 0xF).to(tl.float32) + MAGIC  # [BN/8, 8]
        s = tl.load(s_ptr + g * N + offs_n2, mask=offs_n2 < N, other=0.0)
        w = (q - z[None, :, :]) * s.to(tl.float32)[None, :, :]
        acc = _dot_accumulate(acc, x_ptr, stride_xm, offs_m, offs_k, M, K,
                              tl.reshape(w.to(s_ptr.dtype.element_ty), [BLOCK_K, BLOCK_N]),
                              DOT_FP32)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    _write(out_ptr, offs_m[:, None] * stride_om + offs_n[None, :], acc,
           (offs_m[:, None] < M) & (offs_n[None, :] < N), split_stride, SPLIT)


@triton.jit
def _w8a16_kernel(
    x_ptr, qw_ptr, s_ptr, out_ptr, M, N, K, split_k, stride_xm, stride_om,
    split_stride,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
):
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(tl.program_id(2) * BLOCK_K, K, BLOCK_K * split_k):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(qw_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None],
                    mask=(offs_k[:, None] < K) & n_mask[None, :], other=0)
        # int8 -> fp16 is exact; the per-channel scale is applied to the output
        acc = _dot_accumulate(acc, x_ptr, stride_xm, offs_m, offs_k, M, K, w.to(tl.float16),
                              DOT_FP32)
    s = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    _write(out_ptr, offs_m[:, None] * stride_om + offs_n[None, :], acc * s[None, :],
           (offs_m[:, None] < M) & n_mask[None, :], split_stride, SPLIT)


def default_config(m: int, n: int, k: int, kind: str = "gptq") -> dict[str, int]:
    """Tile sizes by M: the GEMV kernels (``dequant_gemv``) at M = 1, tensor-core tiles above."""
    if m == 1:
        return gemv_config(kind)
    if m <= 16:
        return {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 4}
    if m <= 64:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 2, "num_warps": 4}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 8}


GEMM_KERNELS = {"gptq": _gptq_kernel, "awq": _awq_kernel, "w8a16": _w8a16_kernel}


def _launch(kind: str, x: torch.Tensor, n: int, args: tuple, config: dict | None,
            k_align: int = 1, **constexprs) -> torch.Tensor:
    """Run the GEMV (config BLOCK_M == 1: one program row per row of x) or the GEMM kernel,
    then sum the split-K partials if there are several."""
    m, k = x.shape
    cfg = {**default_config(m, n, k, kind), **(config or {})}
    block_k = min(cfg["BLOCK_K"], k_align) if k_align > 1 else cfg["BLOCK_K"]
    split_k = max(1, min(cfg["SPLIT_K"], triton.cdiv(k, block_k)))
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    dst = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device) if split_k > 1 else out
    common = dict(BLOCK_N=cfg["BLOCK_N"], BLOCK_K=block_k, SPLIT=split_k > 1,
                  num_warps=cfg["num_warps"], num_stages=cfg.get("num_stages", 3), **constexprs)
    if cfg["BLOCK_M"] == 1:
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), m, split_k)
        GEMV_KERNELS[kind][grid](x, *args, dst, n, k, split_k, x.stride(0), n, m * n, **common)
    else:
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, cfg["BLOCK_M"]), split_k)
        GEMM_KERNELS[kind][grid](x, *args, dst, m, n, k, split_k, x.stride(0), n, m * n,
                                 BLOCK_M=cfg["BLOCK_M"], DOT_FP32=interpreting(), **common)
    if split_k > 1:
        _sum_splits[(triton.cdiv(m * n, 1024),)](out, dst, m * n, split_k, BLOCK=1024)
    return out


def _check_x(x: torch.Tensor, k: int) -> None:
    check(x.dim() == 2 and x.shape[1] == k,
          f"x must be [M, K] with K = {k} (from the packed weight), got {tuple(x.shape)}")
    check(x.stride(1) == 1, "x needs a contiguous last dimension")
    check(x.dtype in (torch.float16, torch.bfloat16, torch.float32),
          f"x must be fp16, bf16 or fp32, got {x.dtype}")


def _check_packed(qweight: torch.Tensor, scales: torch.Tensor) -> None:
    check(qweight.dim() == 2, f"qweight must be 2-D, got shape {tuple(qweight.shape)}")
    check_dtype(scales, "scales", FLOAT_DTYPES)


_GROUP_CACHE: dict[int, tuple[weakref.ref, tuple[int, int], int]] = {}


def _trivial_group_size(g_idx: torch.Tensor, num_groups: int) -> int:
    """group_size if g_idx == arange(K) // group_size (no act-order), else 0; also checks that
    g_idx names rows of scales. Cached per tensor so the check (a device sync) runs once per
    layer, not once per call."""
    hit = _GROUP_CACHE.get(id(g_idx))
    if hit is not None and hit[0]() is g_idx and hit[1] == (g_idx._version, num_groups):
        return hit[2]
    k = g_idx.numel()
    lo, hi = (int(g_idx.min()), int(g_idx.max())) if k else (0, 0)
    check(lo >= 0 and hi < num_groups, f"g_idx must name groups in [0, {num_groups}) (the rows "
          f"of scales), got {lo}..{hi}")
    size = k // num_groups if num_groups and k % num_groups == 0 else 0
    if size:
        expect = torch.arange(k, device=g_idx.device) // size
        if not (torch.equal(g_idx.long(), expect) and size % 16 == 0 and size & (size - 1) == 0):
            size = 0
    if len(_GROUP_CACHE) > 4096:
        _GROUP_CACHE.clear()
    _GROUP_CACHE[id(g_idx)] = (weakref.ref(g_idx), (g_idx._version, num_groups), size)
    return size


def gptq_matmul(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
                scales: torch.Tensor, g_idx: torch.Tensor,
                config: dict | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequant(GPTQ) with W [K, N]."""
    _check_packed(qweight, scales)
    k, n = qweight.shape[0] * 8, qweight.shape[1]
    _check_x(x, k)
    check(qweight.dtype == torch.int32 and qzeros.dtype == torch.int32,
          "qweight and qzeros must be int32")
    check(n % 8 == 0, f"N must be a multiple of 8 (qzeros packs 8 columns per int32), got {n}")
    check_dtype(g_idx, "g_idx", INDEX_DTYPES)
    check(scales.dim() == 2 and scales.shape[1] == n and qzeros.shape == (scales.shape[0], n // 8),
          f"scales must be [G, {n}] and qzeros [G, {n // 8}], got {tuple(scales.shape)} and "
          f"{tuple(qzeros.shape)}")
    check(g_idx.numel() == k, f"g_idx must have K = {k} entries, got {g_idx.numel()}")
    group = _trivial_group_size(g_idx, scales.shape[0])
    return _launch("gptq", x, n,
                   (qweight.contiguous(), qzeros.contiguous(), scales.contiguous(),
                    g_idx.to(torch.int32).contiguous()),
                   config, k_align=group or 1, GROUP_SIZE=group)


def awq_matmul(x: torch.Tensor, qweight: torch.Tensor, qzeros: torch.Tensor,
               scales: torch.Tensor, group_size: int,
               config: dict | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ dequant(AWQ GEMM) with W [K, N] (N = 8 x qweight's columns)."""
    _check_packed(qweight, scales)
    k, n = qweight.shape[0], qweight.shape[1] * 8
    _check_x(x, k)
    check(qweight.dtype == torch.int32 and qzeros.dtype == torch.int32,
          "qweight and qzeros must be int32")
    check(group_size >= 16 and group_size & (group_size - 1) == 0 and k % group_size == 0,
          f"group_size must be a power of two >= 16 dividing K = {k}, got {group_size}")
    g = k // group_size
    check(scales.shape == (g, n) and qzeros.shape == (g, n // 8),
          f"scales must be [{g}, {n}] and qzeros [{g}, {n // 8}], got {tuple(scales.shape)} and "
          f"{tuple(qzeros.shape)}")
    return _launch("awq", x, n,
                   (qweight.contiguous(), qzeros.contiguous(), scales.contiguous()),
                   config, k_align=group_size, GROUP_SIZE=group_size)


def w8a16_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 config: dict | None = None) -> torch.Tensor:
    """y [M, N] = x [M, K] @ (qweight [N, K] int8 * scales [N]).T"""
    check(qweight.dim() == 2 and qweight.dtype == torch.int8,
          f"qweight must be int8 [N, K], got {qweight.dtype} {tuple(qweight.shape)}")
    n, k = qweight.shape
    _check_x(x, k)
    check(scales.numel() == n, f"scales must have N = {n} entries, got {scales.numel()}")
    check_dtype(scales, "scales", FLOAT_DTYPES)
    return _launch("w8a16", x, n, (qweight.contiguous(), scales.contiguous()), config)


# ----------------------------------------------------------------------------- references


def unpack_int4_rows(packed: torch.Tensor) -> torch.Tensor:
    """[R, C] int32 -> [8R, C] codes: row 8r+j is nibble j (lowest first) of packed row r."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    codes = (packed[:, None, :] >> shifts[None, :, None]) & 0xF
    return codes.reshape(-1, packed.shape[1])


def unpack_int4_cols(packed: torch.Tensor,
                     order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """[R, C] int32 -> [R, 8C] codes; nibble j of packed column c is column 8c + order[j]."""
    shifts = torch.arange(0, 32, 4, device=packed.device, dtype=torch.int32)
    nib = (packed[:, :, None] >> shifts[None, None, :]) & 0xF  # [R, C, 8] by nibble
    codes = torch.empty_like(nib)
    codes[:, :, list(order)] = nib
    return codes.reshape(packed.shape[0], -1)


def gptq_dequantize_ref(qweight, qzeros, scales, g_idx) -> torch.Tensor:
    q = unpack_int4_rows(qweight)
    z = unpack_int4_cols(qzeros) + 1
    g = g_idx.long()
    return ((q - z[g]).to(scales.dtype) * scales[g])


def awq_dequantize_ref(qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    q = unpack_int4_cols(qweight, AWQ_ORDER)
    z = unpack_int4_cols(qzeros, AWQ_ORDER)
    g = torch.arange(q.shape[0], device=q.device) // group_size
    return ((q - z[g]).to(scales.dtype) * scales[g])


def w8a16_dequantize_ref(qweight, scales) -> torch.Tensor:
    return (qweight.to(scales.dtype) * scales[:, None]).t()


def gptq_matmul_ref(x, qweight, qzeros, scales, g_idx) -> torch.Tensor:
    return (x.float() @ gptq_dequantize_ref(qweight, qzeros, scales, g_idx).float()).to(x.dtype)


def awq_matmul_ref(x, qweight, qzeros, scales, group_size: int) -> torch.Tensor:
    return (x.float() @ awq_dequantize_ref(qweight, qzeros, scales, group_size).float()).to(x.dtype)


def w8a16_matmul_ref(x, qweight, scales) -> torch.Tensor:
    return (x.float() @ (qweight.float() * scales.float()[:, None]).t()).to(x.dtype)


from labkit.kernels.nf4 import nf4_dequantize  # noqa: E402,F401  (interfaces.md names it here)

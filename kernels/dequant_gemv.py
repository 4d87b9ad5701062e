"""Weight-only quantized GEMV for decode (M = 1 token per row): y[n] = sum_k x[k] * W[k, n].

A decode step multiplies one activation row by every weight once, so the kernel's job is to
stream the packed weights at memory speed and spend as few instructions per weight as possible
(4-bit weights arrive 8 per int32: at ~4.5 TB/s that is ~9 T weights/s for the whole GPU, about
the rate an H200 issues single instructions across all its lanes, so every instruction per
weight counts). ``dequant_matmul.py`` has the tensor-core GEMM for larger M; it calls these.

Tiling (program (n, m, k-split) owns BLOCK_N outputs of row m; K is walked in BLOCK_K steps,
every SPLIT_K-th step by this program; split partials are summed by a second small kernel)::

    GPTQ qweight [K/8, N]: one int32 holds 8 consecutive k of one column n
    tile [BLOCK_K/8, BLOCK_N] words ──► for j in 0..7 (unrolled): nibble j of every word

GPTQ, group-factorised. Inside one quantisation group every column n has one scale s and one
zero z, so  sum_k x[k] (q[k,n] - z) s  =  s * (sum_k x[k] q[k,n]  -  z * sum_k x[k]).
Per weight that leaves three instructions: one logic op ORs the nibble into the mantissa of
2^23 (nibble j%4 sits at bit 4*(j%4), so the float is 2^23 + q * 16^(j%4)), one subtract of 2^23
(exact), one FMA with x pre-divided by 16^(j%4) (exact: a power of two). Zero and scale are
applied once per packed word (two FMAs per 8 weights). The 8 nibbles are unrolled over 2-D
tiles, so the K reduction within a word stays in one thread's registers and the accumulator is
[BLOCK_K/8, BLOCK_N] fp32, 8 registers per thread at the default tile (a 3-D [BK/8, 8, BN]
accumulator would need 64 and cut occupancy to a third).

AWQ [K, N/8] packs 8 *columns* into a word, so the group sum runs across rows (threads) and
does not factor cheaply; there each weight is one shift + one logic op (the nibble lands in
the top mantissa bits of 1.0: the float is 1 + q/16), one FMA that applies zero and scale
(16 s * f - (16 + z) s, exact to ~2^-19 s), and one FMA into the accumulator.

Act-order GPTQ (g_idx not k // group_size) has a group per row; that path dequantises each
weight fully before its FMA.

``labkit bench kernels-static`` shows what the compiler made of this for sm_90 (no GPU needed):
the GPTQ loop runs ~5.9 SASS instructions per weight (the 3 above plus loading and converting x,
addresses and masks) in 64 registers, so 8 CTAs (32 warps) fit on an SM to keep loads in flight.
"""

from __future__ import annotations

import triton
import triton.language as tl

MAGIC = tl.constexpr(8388608.0)  # 2^23: OR-ing a small int into the mantissa gives 2^23 + int
MAGIC_BITS = tl.constexpr(0x4B000000)
ONE_BITS = tl.constexpr(0x3F800000)  # 1.0f; OR (q << 19) gives 1 + q / 16


@triton.jit
def _nibble_float(lo, hi, J: tl.constexpr):
    """Nibble J (0..7, lowest first) of a GPTQ word as the fp32 2^23 + q * 16^(J % 4).

    ``lo`` = word | bits(2^23), ``hi`` = (word >> 16) | bits(2^23), made once per word. Then
    (lo & (bits(2^23) | 0xF << 4J)) keeps 2^23's exponent and nibble J: one logic op with one
    immediate per weight (``(w & 0xF) | 2^23`` would need a second constant in a register)."""
    if J >= 4:
        bits = hi & (0x4B000000 | (0xF << ((J - 4) * 4)))
    else:
        bits = lo & (0x4B000000 | (0xF << (J * 4)))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _write_row(out_ptr, offs, y, mask, split_stride, SPLIT: tl.constexpr):
    """Store this program's outputs; with split-K as its fp32 partial (see _sum_splits)."""
    if SPLIT:
        tl.store(out_ptr + tl.program_id(2).to(tl.int64) * split_stride + offs, y, mask=mask)
    else:
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gptq_gemv_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, g_ptr, out_ptr, N, K, split_k, stride_xm, stride_om,
    split_stride,
    GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
):
    pid_m = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    rows8 = tl.arange(0, BLOCK_K // 8)
    z_shift = (offs_n % 8) * 4
    x_row = x_ptr + pid_m * stride_xm
    acc = tl.zeros([BLOCK_K // 8, BLOCK_N], tl.float32)
    for k0 in range(tl.program_id(2) * BLOCK_K, K, BLOCK_K * split_k):
        offs_kp = k0 // 8 + rows8
        kp_mask = offs_kp < K // 8
        qw = tl.load(qw_ptr + offs_kp[:, None] * N + offs_n[None, :],
                     mask=kp_mask[:, None] & n_mask[None, :], other=0)
        lo, hi = qw | MAGIC_BITS, (qw >> 16) | MAGIC_BITS
        if GROUP_SIZE > 0:  # BLOCK_K divides the group: one scale and zero per column
            dot = tl.zeros([BLOCK_K // 8, BLOCK_N], tl.float32)
            xsum = tl.zeros([BLOCK_K // 8], tl.float32)
            for j in tl.static_range(8):
                xj = tl.load(x_row + 8 * offs_kp + j, mask=kp_mask, other=0.0).to(tl.float32)
                xsum += xj
                q = _nibble_float(lo, hi, j) - MAGIC  # q * 16^(j % 4), exact
                dot += (xj * (1.0 / (1 << ((j % 4) * 4))))[:, None] * q
            g = k0 // GROUP_SIZE
            s = tl.load(s_ptr + g * N + offs_n, mask=n_mask, other=0.0).to(tl.float32)
            qz = tl.load(qz_ptr + g * (N // 8) + offs_n // 8, mask=n_mask, other=0)
            z = ((qz >> z_shift) & 0xF).to(tl.float32) + 1.0  # stored as zero - 1
            acc += s[None, :] * (dot - z[None, :] * xsum[:, None])
        else:  # act-order: every row may belong to another group
            for j in tl.static_range(8):
                k = 8 * offs_kp + j
                xj = tl.load(x_row + k, mask=kp_mask, other=0.0).to(tl.float32)
                g = tl.load(g_ptr + k, mask=kp_mask, other=0)
                s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=n_mask[None, :],
                            other=0.0).to(tl.float32)
                qz = tl.load(qz_ptr + g[:, None] * (N // 8) + (offs_n // 8)[None, :],
                             mask=n_mask[None, :], other=0)
                z = ((qz >> z_shift[None, :]) & 0xF).to(tl.float32) + 1.0
                q = (_nibble_float(lo, hi, j) - MAGIC) * (1.0 / (1 << ((j % 4) * 4)))  # exact
                acc += xj[:, None] * ((q - z) * s)
    _write_row(out_ptr, pid_m * stride_om + offs_n, tl.sum(acc, 0), n_mask, split_stride, SPLIT)


@triton.jit
def _awq_gemv_kernel(
    x_ptr, qw_ptr, qz_ptr, s_ptr, out_ptr, N, K, split_k, stride_xm, stride_om, split_stride,
    GROUP_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SPLIT: tl.constexpr,
):
    pid_m = tl.program_id(1)
    offs_np = tl.program_id(0) * (BLOCK_N // 8) + tl.arange(0, BLOCK_N // 8)  # packed columns
    np_mask = offs_np < N // 8
    x_row = x_ptr + pid_m * stride_xm
    # one accumulator per column-in-word c (output column 8p + c): unrolled, all 2-D
    a0 = tl.zeros([BLOCK_K, BLOCK_N // 8], tl.float32)
    a1, a2, a3, a4, a5, a6, a7 = a0, a0, a0, a0, a0, a0, a0
    # splits take whole groups, so each column's constants are built once per group
    for g in range(tl.program_id(2), K // GROUP_SIZE, split_k):
        qz = tl.load(qz_ptr + g * (N // 8) + offs_np, mask=np_mask, other=0)
        s_row = s_ptr + g * N + offs_np * 8
        m0, c0 = _awq_consts(qz, s_row, np_mask, 0)
        m1, c1 = _awq_consts(qz, s_row, np_mask, 1)
        m2, c2 = _awq_consts(qz, s_row, np_mask, 2)
        m3, c3 = _awq_consts(qz, s_row, np_mask, 3)
        m4, c4 = _awq_consts(qz, s_row, np_mask, 4)
        m5, c5 = _awq_consts(qz, s_row, np_mask, 5)
        m6, c6 = _awq_consts(qz, s_row, np_mask, 6)
        m7, c7 = _awq_consts(qz, s_row, np_mask, 7)
        for k0 in range(g * GROUP_SIZE, (g + 1) * GROUP_SIZE, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            qw = tl.load(qw_ptr + offs_k[:, None] * (N // 8) + offs_np[None, :],
                         mask=np_mask[None, :], other=0)
            x = tl.load(x_row + offs_k).to(tl.float32)[:, None]
            a0 += x * (_awq_nibble(qw, 0) * m0 - c0)  # (q - z) s, one FMA: see _awq_consts
            a1 += x * (_awq_nibble(qw, 1) * m1 - c1)
            a2 += x * (_awq_nibble(qw, 2) * m2 - c2)
            a3 += x * (_awq_nibble(qw, 3) * m3 - c3)
            a4 += x * (_awq_nibble(qw, 4) * m4 - c4)
            a5 += x * (_awq_nibble(qw, 5) * m5 - c5)
            a6 += x * (_awq_nibble(qw, 6) * m6 - c6)
            a7 += x * (_awq_nibble(qw, 7) * m7 - c7)
    offs = pid_m * stride_om + offs_np * 8
    _write_row(out_ptr, offs + 0, tl.sum(a0, 0), np_mask, split_stride, SPLIT)
    _write_row(out_ptr, offs + 1, tl.sum(a1, 0), np_mask, split_stride, SPLIT)
    _write_row(out_ptr, offs + 2, tl.sum(a2, 0), np_mask, split_stride, SPLIT)
    _write_row(out_ptr, offs + 3, tl.sum(a3, 0), np_mask, split_stride, SPLIT)
    _write_row(out_ptr, offs + 4, tl.sum(a4, 0), np_mask, split_stride, SPLIT)
    _write_row(out_ptr, offs + 5, tl.sum(a5, 0), np_mask, split_stride, SPLIT)
    _write_row(out_ptr, offs + 6, tl.sum(a6, 0), np_mask, split_stride, SPLIT)
    _write_row(out_ptr, offs + 7, tl.sum(a7, 0), np_mask, split_stride, SPLIT)


@triton.jit
def _awq_consts(qz, s_row, np_mask, C: tl.constexpr):
    """Column C's multiplier and offset for the group: with f = 1 + q/16 (``_awq_nibble``),
    (q - z) s = f * 16 s - (16 + z) s; exact to ~2^-19 s in fp32."""
    shift: tl.constexpr = ((C % 2) * 4 + C // 2) * 4  # column C sits in nibble ORDER.index(C)
    s = tl.load(s_row + C, mask=np_mask, other=0.0).to(tl.float32)
    z = ((qz >> shift) & 0xF).to(tl.float32)
    return (16.0 * s)[None, :], ((16.0 + z) * s)[None, :]


@triton.jit
def _awq_nibble(qw, C: tl.constexpr):
    """Column C of each word as the fp32 1 + q/16: one shift moves the nibble to mantissa bits
    19..22, one logic op masks it and ORs in the bits of 1.0."""
    shift: tl.constexpr = ((C % 2) * 4 + C // 2) * 4
    if shift <= 19:
        bits = qw << (19 - shift)
    else:
        bits = qw >> (shift - 19)
    return ((bits & (0xF << 19)) | ONE_BITS).to(tl.float32, bitcast=True)


@triton.jit
def _w8a16_gemv_kernel(
    x_ptr, qw_ptr, s_ptr, out_ptr, N, K, split_k, stride_xm, stride_om, split_stride,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT: tl.constexpr,
):
    """Per-output-channel scale: applied once to each output, the loop is convert + FMA."""
    pid_m = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_K, BLOCK_N], tl.float32)
    for k0 in range(tl.program_id(2) * BLOCK_K, K, BLOCK_K * split_k):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = tl.load(qw_ptr + offs_n[None, :].to(tl.int64) * K + offs_k[:, None],
                    mask=(offs_k[:, None] < K) & n_mask[None, :], other=0)
        # 2^23 + 128 + q as a float, minus that offset: exact, no int->float conversion
        w = (w.to(tl.int32) + (MAGIC_BITS + 128)).to(tl.float32, bitcast=True) - (MAGIC + 128.0)
        x = tl.load(x_ptr + pid_m * stride_xm + offs_k, mask=offs_k < K, other=0.0)
        acc += x.to(tl.float32)[:, None] * w
    s = tl.load(s_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
    _write_row(out_ptr, pid_m * stride_om + offs_n, tl.sum(acc, 0) * s, n_mask, split_stride,
               SPLIT)


def gemv_config(kind: str) -> dict[str, int]:
    """Default GEMV tiles (BLOCK_M = 1 selects these kernels). Split-K fills the GPU when
    N / BLOCK_N programs alone would not. AWQ keeps a [BLOCK_K, BLOCK_N] accumulator, so it
    takes short K steps to keep registers (and so occupancy) in line with GPTQ."""
    if kind == "awq":
        return {"BLOCK_M": 1, "BLOCK_N": 128, "BLOCK_K": 32, "SPLIT_K": 4, "num_warps": 4}
    return {"BLOCK_M": 1, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 4}


KERNELS = {"gptq": _gptq_gemv_kernel, "awq": _awq_gemv_kernel, "w8a16": _w8a16_gemv_kernel}

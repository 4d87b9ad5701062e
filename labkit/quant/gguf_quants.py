"""llama.cpp's block quantizers in numpy: Q8_0, Q4_0, Q5_0 and the k-quants Q4_K and Q6_K.

GGML stores a weight row as a run of fixed-size *blocks*, each holding its own scale(s) next to
its integer codes, so a kernel can dequantize any block without looking elsewhere:

  Q8_0  32 weights: fp16 d, 32 x int8            w = d * q                  8.5 bits/weight
  Q4_0  32 weights: fp16 d, 16 bytes of nibbles  w = d * (q - 8)            4.5 bits/weight
  Q5_0  32 weights: fp16 d, 32 high bits, nibbles w = d * (q - 16)          5.5 bits/weight
  Q4_K 256 weights = 8 sub-blocks of 32: fp16 d, fp16 dmin, 8 x (6-bit scale, 6-bit min),
        128 bytes of nibbles                     w = d*sc_j * q - dmin*m_j  4.5 bits/weight
  Q6_K 256 weights = 16 sub-blocks of 16: 6-bit codes, int8 scale each, fp16 d
                                                 w = d*sc_j * (q - 32)      6.5625 bits/weight

The k-quants ("super-blocks") quantize the *scales* too: each 32-weight group gets a float scale
and min, and those 16 floats are themselves stored as 6-bit integers against two fp16 super-
scales. That is how Q4_K affords an asymmetric (scale + min) grid at the cost of Q4_0's
symmetric one. The codes are chosen by a small search (``make_qkx2_quants``) that tries 21 grid
stretches and keeps the one with the least weighted squared error.

Every function follows llama.cpp's reference C (``quantize_row_*_ref`` in ggml-quants.c) step for
step in float32, including sequential (not pairwise) sums and its round-half-to-even trick, so
the bytes equal what ``llama-quantize`` writes without an importance matrix. Q8_0/Q4_0/Q5_0 are
also checked against the ``gguf`` package's numpy reference.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32
QK = 32  # block size of Q8_0 / Q4_0 / Q5_0
QK_K = 256  # super-block size of the k-quants
BLOCK_BYTES = {"q8_0": 34, "q4_0": 18, "q5_0": 22, "q4_k": 144, "q6_k": 210}
BLOCK_SIZE = {"q8_0": QK, "q4_0": QK, "q5_0": QK, "q4_k": QK_K, "q6_k": QK_K}


# ---- float32 helpers that behave like the C code ------------------------------------------
def nearest_int(v: np.ndarray) -> np.ndarray:
    """ggml's rounding: add 1.5*2^23 so the float's mantissa *is* the integer (ties to even)."""
    bits = (np.asarray(v, F32) + F32(12582912.0)).view(np.int32)
    return (bits & 0x007FFFFF) - 0x00400000


def round_away(v: np.ndarray) -> np.ndarray:
    """C's roundf: halves away from zero (np.round would send 2.5 to 2)."""
    v = np.asarray(v, np.float64)  # |v| < 2^24, so +0.5 is exact in float64
    return np.sign(v) * np.floor(np.abs(v) + 0.5)


def seq_sum(a: np.ndarray) -> np.ndarray:
    """Sum over the last axis left to right in float32, as a C loop does (numpy sums pairwise)."""
    acc = a[..., 0].astype(F32)
    for i in range(1, a.shape[-1]):
        acc = acc + a[..., i]
    return acc


def first_absmax(x: np.ndarray) -> np.ndarray:
    """The signed value with the largest |x| per row; the first one wins ties, as in the C loop."""
    return np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)


def fp16_bytes(v: np.ndarray) -> np.ndarray:
    """[n] float32 -> [n, 2] uint8, rounded to nearest even like GGML_FP32_TO_FP16."""
    return np.asarray(v, F32).astype(np.float16).reshape(-1, 1).view(np.uint8)


def fp16_round(v: np.ndarray) -> np.ndarray:
    return np.asarray(v, F32).astype(np.float16).astype(F32)


def _blocks(x: np.ndarray, size: int) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=F32)
    return x.reshape(-1, size)


# ---- 32-weight blocks -----------------------------------------------------------------------
def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """[n*32] -> [n, 34] bytes: d = max|x| / 127, q = round(x / d) (halves away from zero)."""
    b = _blocks(x, QK)
    d = np.abs(b).max(-1, keepdims=True) / F32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, F32(0), F32(1) / d)
    q = round_away(b * inv).astype(np.int8).view(np.uint8)
    return np.concatenate([fp16_bytes(d), q], axis=1)


def _symmetric_codes(b: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """Q4_0/Q5_0's grid: d = max / -levels/2 (signed!), q = trunc(x/d + levels/2 + 0.5).

    Using the signed extreme makes it land exactly on code 0, so the whole range -8..7 is used
    with the larger-magnitude side getting the extra level.
    """
    half = levels // 2
    d = first_absmax(b) / F32(-half)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, F32(0), F32(1) / d)
    q = np.trunc(b * inv + F32(half + 0.5)).astype(np.int32)
    return d, np.minimum(levels - 1, q).astype(np.uint8)


def _pack_nibbles_halves(q: np.ndarray) -> np.ndarray:
    """Byte j holds weight j in its low nibble and weight j+16 in its high nibble."""
    return (q[:, :QK // 2] & 0x0F) | ((q[:, QK // 2:] & 0x0F) << 4)


def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    """[n*32] -> [n, 18] bytes: fp16 d, then 16 bytes of 4-bit codes (w = d * (q - 8))."""
    d, q = _symmetric_codes(_blocks(x, QK), 16)
    return np.concatenate([fp16_bytes(d), _pack_nibbles_halves(q)], axis=1)


def quantize_q5_0(x: np.ndarray) -> np.ndarray:
    """[n*32] -> [n, 22] bytes: fp16 d, the 32 fifth bits as a uint32, then the low nibbles."""
    d, q = _symmetric_codes(_blocks(x, QK), 32)
    high = ((q >> 4) & 1).astype(np.uint32) << np.arange(QK, dtype=np.uint32)
    qh = np.bitwise_or.reduce(high, axis=1).astype("<u4").reshape(-1, 1).view(np.uint8)
    return np.concatenate([fp16_bytes(d), qh, _pack_nibbles_halves(q)], axis=1)


# ---- Q4_K: 8 x 32 weights with a 6-bit scale and min each ---------------------------------
def make_qkx2_quants(x: np.ndarray, w: np.ndarray, nmax: int = 15, rmin: float = -1.0,
                     rdelta: float = 0.1, nstep: int = 20) -> tuple[np.ndarray, ...]:
    """Best (scale, min, codes) per row for ``x ≈ scale * L - min`` with L in 0..nmax.

    Start from the plain min/max grid, then stretch it by (rmin + rdelta*i) levels and, for each
    rounding that gives, solve the weighted least-squares scale and min in closed form; keep the
    lowest weighted error. Returns (scale [n], the_min [n] >= 0, L [n, 32] uint8).
    """
    mn = np.minimum(x.min(-1), F32(0))
    mx = x.max(-1)
    sum_w, sum_x = seq_sum(w), seq_sum(w * x)
    flat = mx == mn
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = F32(nmax) / (mx - mn)
        scale = F32(1) / iscale
        L = np.clip(nearest_int(iscale[:, None] * (x - mn[:, None])), 0, nmax)
        diff = scale[:, None] * L.astype(F32) + mn[:, None] - x
        best = seq_sum(w * (diff * diff))
        for i in range(nstep + 1):
            iscale = (F32(rmin) + F32(rdelta) * F32(i) + F32(nmax)) / (mx - mn)
            la = np.clip(nearest_int(iscale[:, None] * (x - mn[:, None])), 0, nmax).astype(F32)
            wl = w * la
            sum_l, sum_l2, sum_xl = seq_sum(wl), seq_sum(wl * la), seq_sum(wl * x)
            D = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            pos = this_min > 0
            this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
            this_min = np.where(pos, F32(0), this_min)
            diff = this_scale[:, None] * la + this_min[:, None] - x
            err = seq_sum(w * (diff * diff))
            take = (D > 0) & (err < best) & ~flat
            L = np.where(take[:, None], la.astype(L.dtype), L)
            best = np.where(take, err, best)
            scale = np.where(take, this_scale, scale)
            mn = np.where(take, this_min, mn)
    scale = np.where(flat, F32(0), scale)
    L = np.where(flat[:, None], 0, L)
    return scale.astype(F32), (-mn).astype(F32), L.astype(np.uint8)


def pack_k4_scales(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """8 six-bit scales + 8 six-bit mins -> 12 bytes (ggml's get_scale_min_k4 layout).

    Bytes 0-3: scale 0-3 (low 6 bits) with scale 4-7's top 2 bits above; bytes 4-7: the same for
    the mins; bytes 8-11: the low nibbles of scale 4-7 and min 4-7.
    """
    out = np.zeros((ls.shape[0], 12), np.uint8)
    out[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    out[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:] & 0x0F) | ((lm[:, 4:] & 0x0F) << 4)
    return out


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """[n*256] -> [n, 144] bytes, as llama.cpp's quantize_row_q4_K_ref."""
    sub = _blocks(x, 32)  # [n*8, 32]
    n = sub.shape[0] // 8
    av_x = np.sqrt(seq_sum(sub * sub) / F32(32))
    weights = av_x[:, None] + np.abs(sub)  # weight big values more, but never zero
    scales, mins, L = make_qkx2_quants(sub, weights)
    scales, mins, L = scales.reshape(n, 8), mins.reshape(n, 8), L.reshape(n, 8, 32)
    max_scale = np.maximum(scales.max(-1), F32(0))
    max_min = np.maximum(mins.max(-1), F32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0))
        inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0))
    ls = np.minimum(63, nearest_int(inv_scale[:, None] * scales) & 0xFF).astype(np.uint8)
    lm = np.minimum(63, nearest_int(inv_min[:, None] * mins) & 0xFF).astype(np.uint8)
    d, dmin = fp16_round(max_scale / F32(63)), fp16_round(max_min / F32(63))
    # Re-round every weight against the *stored* (quantized) scale and min.
    dj = d[:, None] * ls.astype(F32)
    dmj = dmin[:, None] * lm.astype(F32)
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(nearest_int((sub.reshape(n, 8, 32) + dmj[..., None]) / dj[..., None]),
                          0, 15).astype(np.uint8)
    L = np.where((dj != 0)[..., None], requant, L).reshape(n, 4, 2, 32)
    qs = (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(n, 128)
    return np.concatenate([fp16_bytes(d), fp16_bytes(dmin), pack_k4_scales(ls, lm), qs], axis=1)


# ---- Q6_K: 16 x 16 weights with an int8 scale each ----------------------------------------
def make_qx_quants(x: np.ndarray, nmax: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Best symmetric scale per row (rmse_type 1: error weighted by x^2), trying 19 grids.

    Returns (scale [n], L [n, k] codes + nmax of the last accepted grid; 0 for all-zero rows).
    """
    mx = first_absmax(x)[:, 0]
    zero = np.abs(mx) < F32(1e-15)
    w = x * x

    def fit(iscale):
        lv = np.clip(nearest_int(iscale[:, None] * x), -nmax, nmax - 1)
        lf = lv.astype(F32)
        return seq_sum((w * x) * lf), seq_sum((w * lf) * lf), lv + nmax

    with np.errstate(divide="ignore", invalid="ignore"):
        sumlx, suml2, L = fit(F32(-nmax) / mx)
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
        best = scale * sumlx
        for i in (*range(-9, 0), *range(1, 10)):
            sumlx, suml2, la = fit(-(F32(nmax) + F32(0.1) * F32(i)) / mx)
            take = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            scale = np.where(take, sumlx / suml2, scale)
            best = np.where(take, scale * sumlx, best)
            L = np.where(take[:, None], la, L)
    return np.where(zero, F32(0), scale).astype(F32), np.where(zero[:, None], 0, L)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """[n*256] -> [n, 210] bytes, as llama.cpp's quantize_row_q6_K_ref."""
    sub = _blocks(x, 16)
    n = sub.shape[0] // 16
    scales, first = make_qx_quants(sub)
    scales = scales.reshape(n, 16)
    max_scale = first_absmax(scales)[:, 0]
    zero = np.abs(max_scale) < F32(1e-15)
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(zero, F32(0), F32(-128) / max_scale)
        d = fp16_round(np.where(zero, F32(0), F32(1) / iscale))
        sc = np.minimum(127, nearest_int(iscale[:, None] * scales)).astype(np.int8)
        dj = d[:, None] * sc.astype(F32)
        L = np.clip(nearest_int(sub.reshape(n, 16, 16) / dj[..., None]), -32, 31) + 32
    # where the stored scale is 0 the C keeps make_qx_quants' codes (they dequantize to 0)
    L = np.where((dj != 0)[..., None], L, first.reshape(n, 16, 16))
    L = np.where(zero[:, None, None], 0, L)  # an all-zero super-block is memset to 0
    L = L.reshape(n, 2, 4, 32).astype(np.uint8)  # [n, 128-half, 32-quarter, 32]
    ql = np.concatenate([L[:, :, 0] & 0xF | (L[:, :, 2] & 0xF) << 4,
                         L[:, :, 1] & 0xF | (L[:, :, 3] & 0xF) << 4], axis=2).reshape(n, 128)
    qh = (L[:, :, 0] >> 4 | (L[:, :, 1] >> 4) << 2 | (L[:, :, 2] >> 4) << 4
          | (L[:, :, 3] >> 4) << 6).reshape(n, 64)
    sc = np.where(zero[:, None], 0, sc).astype(np.int8).view(np.uint8)
    return np.concatenate([ql, qh, sc, fp16_bytes(d)], axis=1)


QUANTIZERS = {"q8_0": quantize_q8_0, "q4_0": quantize_q4_0, "q5_0": quantize_q5_0,
              "q4_k": quantize_q4_k, "q6_k": quantize_q6_k}

"""Exercises: INT8 per-channel, INT4 group-wise asymmetric, and NF4 lookup.

Weight-only quantization stores small integers plus a few floats per group and rebuilds
``W ≈ (q - zero) * scale`` right before the matmul. Decode is memory-bound, so fewer weight bytes
mean proportionally faster tokens. The references are ``labkit.quant`` (``quantize_int8``,
``quantize_rtn``, ``quantize_nf4``, whose NF4 codes equal bitsandbytes' bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from labkit.exercises.checks import CheckFailure, call, run_check, short
from labkit.quant.nf4 import NF4_CODE, quantize_nf4
from labkit.quant.rtn import quantize_int8, quantize_rtn

__all__ = ["NF4_CODE", "check_int4", "check_int8", "check_nf4"]  # NF4_CODE: the notebook's table

def _weights() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(8, 64, generator=g), torch.randn(16, 128, generator=g) * 0.02,
          torch.rand(4, 32, generator=g) + 0.5,  # all positive: the range must still hold 0
          torch.randn(3, 256, generator=g) * torch.logspace(-3, 1, 3)[:, None]]
    w = torch.randn(4, 64, generator=g)
    w[1] = 0.0  # an all-zero row/group
    w[2, 5] = 40.0  # an outlier
    ws.append(w)
    return ws


def _tensor(x: Any, name: str, shape: tuple, inputs: str, hint: str = "") -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or tuple(x.shape) != tuple(shape):
        raise CheckFailure(f"{name} has the wrong type or shape", inputs=inputs,
                           expected=f"tensor of shape {list(shape)}", actual=short(x), hint=hint)
    return x


def _codes_match(mine: torch.Tensor, ref: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    """Positions where codes differ beyond a rounding tie (w/scale within 1e-3 of x.5)."""
    tie = ((ratio - ratio.floor()) - 0.5).abs() < 1e-3
    return (mine.long() != ref.long()) & ~(tie & ((mine.long() - ref.long()).abs() <= 1))


def _lo(w: torch.Tensor, gs: int) -> torch.Tensor:
    """-min(min(group), 0) per [row, group]: the quantity zero is rounded from (times 1/scale)."""
    n, k = w.shape
    return -w.float().reshape(n, k // gs, gs).amin(dim=2).clamp(max=0)


def _first_diff(expect: torch.Tensor, actual: torch.Tensor) -> str:
    bad = ~torch.isclose(actual.float(), expect.float(), rtol=1e-5, atol=1e-6)
    if not bad.any():
        return ""
    idx = tuple(int(x) for x in bad.nonzero()[0])
    return (f"\n            first difference at index {list(idx)}: expected "
            f"{float(expect[idx]):.6g}, got {float(actual[idx]):.6g}")


def check_int8(quantize_int8_per_channel: Callable, dequantize_int8: Callable) -> object:
    def body() -> str:
        worst = 0.0
        for w in _weights():
            inputs = f"w={short(w)}"
            out = call(quantize_int8_per_channel, w.clone(),
                       _label=f"quantize_int8_per_channel({inputs})")
            if not (isinstance(out, tuple) and len(out) == 2):
                raise CheckFailure("return (q, scale)", inputs=inputs, expected="a 2-tuple",
                                   actual=short(out))
            q = _tensor(out[0], "q", tuple(w.shape), inputs)
            scale = _tensor(out[1], "scale", (w.shape[0],), inputs,
                            "one scale per output channel (row): scale has shape [N].")
            if q.dtype != torch.int8:
                raise CheckFailure("q must be int8", inputs=inputs, expected=torch.int8,
                                   actual=q.dtype, hint="q.to(torch.int8) after clamping.")
            ref_q, ref_s = quantize_int8(w)
            nz = w.abs().amax(dim=1) > 0
            if not torch.allclose(scale.float()[nz], ref_s.float()[nz], rtol=2e-3):
                i = int(((scale.float() - ref_s.float()).abs() / ref_s.float())[nz].argmax())
                i = int(nz.nonzero()[i])
                raise CheckFailure(f"wrong scale for row {i}", inputs=inputs,
                                   expected=float(ref_s[i]), actual=float(scale[i]),
                                   hint="scale = max |w| over the row / 127 (symmetric: 127, "
                                        "not 128 or 255; per row, not per tensor or column).")
            # codes are judged against YOUR (already validated) scale: labkit rounds its scale
            # to fp16 first, which moves a few near-tie codes by one
            ratio = w.float() / scale.float().clamp(min=1e-12)[:, None]
            want_q = ratio.round().clamp(-127, 127)
            bad = _codes_match(q, want_q, ratio)
            if bad.any():
                i, j = (int(x) for x in bad.nonzero()[0])
                raise CheckFailure(f"wrong code at [{i}, {j}]", inputs=f"w[{i}, {j}]={w[i, j]:.6g}"
                                   f", your scale[{i}]={float(scale[i]):.6g}",
                                   expected=int(want_q[i, j]), actual=int(q[i, j]),
                                   hint="round to nearest (torch.round), then clamp to ±127.")
            w_hat = call(dequantize_int8, q, scale, _label="dequantize_int8(q, scale)")
            w_hat = _tensor(w_hat, "dequantize_int8(q, scale)", tuple(w.shape), inputs)
            expect = q.float() * scale.float()[:, None]
            if not torch.allclose(w_hat.float(), expect, rtol=1e-5, atol=1e-7):
                raise CheckFailure("dequantize_int8 is not q * scale per row", inputs=inputs,
                                   expected=short(expect), actual=short(w_hat),
                                   hint="scale[:, None] broadcasts one scale over each row.")
            worst = max(worst, float(((w_hat - w).abs().amax(dim=1) / scale.clamp(min=1e-12)
                                      ).max()))
        return (f"scales match labkit.quant.quantize_int8, every code is the nearest; worst "
                f"error {worst:.3f} scale steps (≤ 0.5 means exact rounding). INT8 halves fp16 "
                "weight bytes.")

    return run_check("int8_per_channel", body)


def _int4_outputs(quantize_int4_groupwise: Callable, w: torch.Tensor, gs: int,
                  inputs: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The learner's (codes, scales, zeros), refused early if the tuple, a shape or the codes'
    dtype is wrong, so the value checks after it can index them."""
    n, k = w.shape
    out = call(quantize_int4_groupwise, w.clone(), gs,
               _label=f"quantize_int4_groupwise({inputs})")
    if not (isinstance(out, tuple) and len(out) == 3):
        raise CheckFailure("return (codes, scales, zeros)", inputs=inputs,
                           expected="a 3-tuple", actual=short(out))
    hint = "one (scale, zero) per row and group: shape [N, K // group_size]."
    codes = _tensor(out[0], "codes", (n, k), inputs)
    scales = _tensor(out[1], "scales", (n, k // gs), inputs, hint)
    zeros = _tensor(out[2], "zeros", (n, k // gs), inputs, hint)
    if codes.dtype != torch.uint8:
        raise CheckFailure("codes must be uint8", inputs=inputs, expected=torch.uint8,
                           actual=codes.dtype, hint="codes.to(torch.uint8) after "
                           "clamping to [0, 15]: two of them pack into one byte.")
    return codes, scales, zeros


def _check_int4_scales_zeros(w: torch.Tensor, gs: int, scales: torch.Tensor,
                             zeros: torch.Tensor, ref_s: torch.Tensor, ref_z: torch.Tensor,
                             inputs: str) -> None:
    """Scales to a relative 2e-3 and zero points exactly, except where rounding sits on a tie
    or a group is all zeros (no range: any positive finite scale will do)."""
    n, k = w.shape
    flat = (w.float().reshape(n, k // gs, gs) == 0).all(dim=2)  # no range at all
    sbad = ((scales.float() - ref_s).abs() > 2e-3 * ref_s.abs()) & ~flat
    sbad |= flat & ~(torch.isfinite(scales.float()) & (scales.float() > 0))
    if sbad.any():
        i, g = (int(x) for x in sbad.nonzero()[0])
        grp = w[i, g * gs:(g + 1) * gs]
        raise CheckFailure(
            f"wrong scale for row {i}, group {g}", inputs=f"{inputs}; that group: "
            f"min={float(grp.min()):.4g}, max={float(grp.max()):.4g}",
            expected=float(ref_s[i, g]), actual=float(scales[i, g]),
            hint="the range must include 0: lo = min(min, 0), hi = max(max, 0); "
                 "scale = (hi - lo) / 15 per group of columns of one row.")
    ratio_z = _lo(w, gs) / scales.float().clamp(min=1e-12)
    near_tie = (ratio_z.frac() - 0.5).abs() < 1e-2
    zbad = (zeros.float() != ref_z) & ~(near_tie & ((zeros.float() - ref_z).abs() <= 1))
    zbad &= ~flat
    if zbad.any():
        i, g = (int(x) for x in zbad.nonzero()[0])
        raise CheckFailure(f"wrong zero point for row {i}, group {g}", inputs=inputs,
                           expected=float(ref_z[i, g]), actual=float(zeros[i, g]),
                           hint="zero = round(-lo / scale), clamped to [0, 15].")


def _check_int4_codes(w: torch.Tensor, gs: int, codes: torch.Tensor, scales: torch.Tensor,
                      zeros: torch.Tensor) -> None:
    """Codes judged against YOUR validated (scale, zero), as for INT8: a scale within tolerance
    of labkit's may still move a near-tie code by one."""
    n, k = w.shape
    ratio = w.float().reshape(n, k // gs, gs) / scales.float()[..., None]
    want = (ratio.round() + zeros.float()[..., None]).clamp(0, 15).reshape(n, k)
    bad = _codes_match(codes, want, ratio.reshape(n, k))
    if bad.any():
        i, j = (int(x) for x in bad.nonzero()[0])
        raise CheckFailure(
            f"wrong code at [{i}, {j}]", inputs=f"w[{i}, {j}]={w[i, j]:.6g}, "
            f"scale={float(scales[i, j // gs]):.6g}, zero={float(zeros[i, j // gs])}",
            expected=int(want[i, j]), actual=int(codes[i, j]),
            hint="codes = clamp(round(w / scale) + zero, 0, 15).")


def check_int4(quantize_int4_groupwise: Callable, dequantize_int4_groupwise: Callable) -> object:
    def body() -> str:
        for w in _weights():
            for gs in (16, 32):
                n, k = w.shape
                inputs = f"w={short(w)}, group_size={gs}"
                codes, scales, zeros = _int4_outputs(quantize_int4_groupwise, w, gs, inputs)
                ref = quantize_rtn(w, bits=4, group_size=gs)
                ref_s, ref_z = ref.scales.T, ref.zeros.T.float()  # labkit stores [G, N]
                _check_int4_scales_zeros(w, gs, scales, zeros, ref_s, ref_z, inputs)
                _check_int4_codes(w, gs, codes, scales, zeros)
                w_hat = call(dequantize_int4_groupwise, ref.codes.clone(), ref_s.clone(),
                             ref_z.clone(), gs, _label="dequantize_int4_groupwise(<labkit's "
                             "codes, scales, zeros>, group_size)")
                expect = ref.dequantize()
                w_hat = _tensor(w_hat, "dequantized weight", (n, k), inputs)
                if not torch.allclose(w_hat.float(), expect, rtol=1e-5, atol=1e-6):
                    raise CheckFailure("dequantize_int4_groupwise is wrong",
                                       inputs=inputs + _first_diff(expect, w_hat),
                                       expected=short(expect), actual=short(w_hat),
                                       hint="(codes - zero) * scale with the pair of the "
                                            "code's own group (column // group_size).")
        return ("codes, scales and zeros equal labkit.quant.quantize_rtn (GPTQ's min/max "
                "rule). At group 128 INT4 costs ≈4.16 bits/weight (an fp16 scale and a 4-bit "
                "zero per 128).")

    return run_check("int4_groupwise", body)


def check_nf4(nf4_quantize: Callable, nf4_dequantize: Callable) -> object:
    def body() -> str:
        for w in _weights():
            for bs in (32, 64):
                inputs = f"w={short(w)}, blocksize={bs}"
                out = call(nf4_quantize, w.clone(), bs, _label=f"nf4_quantize({inputs})")
                if not (isinstance(out, tuple) and len(out) == 2):
                    raise CheckFailure("return (codes, absmax)", inputs=inputs,
                                       expected="a 2-tuple", actual=short(out))
                ref = quantize_nf4(w, blocksize=bs)
                codes = _tensor(out[0], "codes", (w.numel(),), inputs,
                                "one code per element, flattened row-major (unpacked).")
                absmax = _tensor(out[1], "absmax", (w.numel() // bs,), inputs,
                                 "one absmax per block of `blocksize` consecutive elements.")
                if codes.dtype != torch.uint8 or absmax.dtype != torch.float32:
                    raise CheckFailure("wrong dtypes", inputs=inputs,
                                       expected="codes uint8, absmax float32",
                                       actual=f"codes {codes.dtype}, absmax {absmax.dtype}",
                                       hint="codes.to(torch.uint8); absmax stays float32.")
                if not torch.allclose(absmax.float(), ref.absmax.float()):
                    raise CheckFailure("wrong absmax", inputs=inputs, expected=short(ref.absmax),
                                       actual=short(absmax),
                                       hint="absmax of each block of the FLATTENED weight.")
                x = w.float().reshape(-1, bs) / ref.absmax.clamp(min=1e-12)[:, None]
                x = x.reshape(-1)
                d_mine = (NF4_CODE[codes.long().clamp(0, 15)] - x).abs()
                d_ref = (NF4_CODE[ref.codes.long()] - x).abs()
                bad = (d_mine > d_ref + 1e-6) | (codes.long() > 15)
                if bad.any():
                    i = int(bad.nonzero()[0])
                    raise CheckFailure(f"code {i} is not the nearest level",
                                       inputs=f"w/absmax = {float(x[i]):.6f}",
                                       expected=int(ref.codes[i]), actual=int(codes[i]),
                                       hint="argmin over the 16 levels of |level - w/absmax|.")
                w_hat = call(nf4_dequantize, ref.codes.clone(), ref.absmax.clone(), bs,
                             tuple(w.shape), _label="nf4_dequantize(<labkit's codes, absmax>, "
                             f"{bs}, {tuple(w.shape)})")
                expect = ref.dequantize()
                w_hat = _tensor(w_hat, "nf4_dequantize(...)", tuple(w.shape), inputs)
                if not torch.allclose(w_hat.float(), expect.float(), rtol=1e-6, atol=1e-7):
                    raise CheckFailure("wrong lookup", inputs=inputs + _first_diff(
                                           expect.reshape(-1), w_hat.reshape(-1)) +
                                           f" (block size {bs})", expected=short(expect),
                                       actual=short(w_hat),
                                       hint="NF4_CODE[codes] * absmax[i // blocksize], then "
                                            "reshape (element i belongs to block i // blocksize).")
        return ("codes equal labkit's (which equal bitsandbytes' quantize_4bit bit for bit). "
                "NF4 levels are normal quantiles: each code used about equally often.")

    return run_check("nf4_lookup", body)

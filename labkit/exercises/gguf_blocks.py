"""Exercise: llama.cpp's Q8_0 and Q4_0 block quantizers, byte for byte.

A GGUF file stores a weight row as 32-weight blocks, each with its fp16 scale in front of its
codes. You write the two simplest block formats; the reference is the ``gguf`` package's numpy
port of ggml's C (``gguf.quants.quantize``), and the check compares *bytes*, so every detail
counts: the scale's rounding to fp16, C's ``roundf`` (halves away from zero), Q4_0's signed
extreme and its nibble order. A failure names the block, decodes both sides and gives a hint.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from labkit.exercises.checks import CheckFailure, call, run_check, short

CONTRACT_Q8_0 = '''
def quantize_q8_0(x: np.ndarray) -> np.ndarray:
    """x: float32 [n * 32]. Returns uint8 [n, 34]: per block of 32 weights,
    d = max|x| / 127 (float32, then stored as float16: 2 little-endian bytes),
    q = round(x / d) with halves AWAY from zero (C's roundf; np.round rounds halves to even),
    q as int8 (32 bytes). A block of zeros has d = 0 and q = 0 (never divide by 0)."""
'''

CONTRACT_Q4_0 = '''
def quantize_q4_0(x: np.ndarray) -> np.ndarray:
    """x: float32 [n * 32]. Returns uint8 [n, 18]: per block of 32 weights,
    m = the value with the largest |x| (keep its SIGN; the first one on ties),
    d = m / -8, id = 1 / d (0 if d == 0), q = min(15, int(x * id + 8.5)) (truncation),
    d as float16 (2 bytes), then 16 bytes: byte j = q[j] | (q[j + 16] << 4)."""
'''


def _cases() -> list[tuple[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    ties = np.zeros(32, np.float32)
    ties[:6] = [127.0, 2.5, -3.5, 0.5, -0.5, 64.5]  # d = 1: exact halves after scaling
    neg = -np.abs(rng.standard_normal(32)).astype(np.float32)  # extreme is negative
    mixed = rng.standard_normal(32 * 8).astype(np.float32) * 0.02
    mixed[40] = 0.9  # an outlier in the second block
    return [("32 random weights", rng.standard_normal(32).astype(np.float32)),
            ("a block of zeros then random", np.r_[np.zeros(32, np.float32),
                                                   rng.standard_normal(32).astype(np.float32)]),
            ("halves after scaling (d = 1)", ties), ("all-negative block", neg),
            ("8 blocks of small weights with an outlier", mixed)]


def _reference(name: str, x: np.ndarray) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    return quantize(x.reshape(-1, 32), GGMLQuantizationType[name.upper()])


def _decode(block: np.ndarray, name: str) -> str:
    d = float(block[:2].view(np.float16)[0])
    if name == "q8_0":
        q = block[2:].view(np.int8)
    else:
        q = np.r_[block[2:] & 0x0F, block[2:] >> 4]
    return f"d={d:.6g}, codes={q.tolist()}"


def _hint(name: str, ref: np.ndarray, got: np.ndarray) -> str:
    if not np.array_equal(ref[:2], got[:2]):
        if name == "q8_0":
            return "d is max|x| / 127 in float32, stored with .astype(np.float16).view(np.uint8)"
        if np.array_equal(ref[:2].view(np.float16), -got[:2].view(np.float16)):
            return "d must carry the SIGN of the extreme value: d = m / -8 with m signed"
        return "d = m / -8 where m is the signed value of largest magnitude, stored as float16"
    if name == "q8_0":
        return "codes differ: round halves away from zero (np.sign(v) * np.floor(|v| + 0.5))"
    codes = lambda b: np.r_[b[2:] & 0x0F, b[2:] >> 4]  # noqa: E731
    if np.array_equal(np.sort(codes(ref)), np.sort(codes(got))):
        return "nibble order: byte j holds q[j] in the low 4 bits and q[j + 16] in the high 4"
    return ("codes differ: q = min(15, trunc(x * id + 8.5)), id = 1 / d; the +8 offset makes "
            "the codes 0..15, the extra 0.5 with truncation rounds")


def _check_bytes(name: str, fn: Callable[[np.ndarray], Any]) -> str:
    for label, x in _cases():
        ref = _reference(name, x)
        got = call(fn, x.copy(), _label=f"{name} of {label}")
        got = np.asarray(got) if got is not None else got
        if not isinstance(got, np.ndarray) or got.shape != ref.shape or got.dtype != np.uint8:
            raise CheckFailure(f"{name} returned the wrong type or shape", inputs=label,
                               expected=f"numpy uint8 array of shape {list(ref.shape)}",
                               actual=short(got), hint="one row of bytes per 32-weight block")
        bad = np.flatnonzero((got != ref).any(1))
        if bad.size:
            b = int(bad[0])
            raise CheckFailure(f"{name}: block {b} has different bytes", inputs=label,
                               expected=_decode(ref[b], name), actual=_decode(got[b], name),
                               hint=_hint(name, ref[b], got[b]))
    return "bytes identical to the gguf package on every block"


def check_q8_0(fn: Callable[[np.ndarray], Any]) -> Any:
    return run_check("gguf_q8_0", lambda: _check_bytes("q8_0", fn))


def check_q4_0(fn: Callable[[np.ndarray], Any]) -> Any:
    return run_check("gguf_q4_0", lambda: _check_bytes("q4_0", fn))


def reference_q8_0(x: np.ndarray) -> np.ndarray:
    from labkit.quant.gguf_quants import quantize_q8_0

    return quantize_q8_0(x)


def reference_q4_0(x: np.ndarray) -> np.ndarray:
    from labkit.quant.gguf_quants import quantize_q4_0

    return quantize_q4_0(x)


def inject(name: str, learner_fn: Any) -> Any:
    """This exercise's references under ``LABKIT_INJECT_SOLUTIONS=1`` (CI), else the learner's."""
    if os.environ.get("LABKIT_INJECT_SOLUTIONS") != "1":
        return learner_fn
    return {"quantize_q8_0": reference_q8_0, "quantize_q4_0": reference_q4_0}[name]

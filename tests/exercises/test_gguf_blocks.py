"""The GGUF block-quantizer exercise: the references pass, plausible mistakes are caught with a
message naming them (negative controls)."""

import numpy as np
import pytest

from labkit.exercises import gguf_blocks

pytest.importorskip("gguf")


@pytest.fixture(autouse=True)
def _progress(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_PROGRESS", str(tmp_path / "progress.json"))


def q8_round_half_even(x):
    b = x.reshape(-1, 32)
    d = np.abs(b).max(1, keepdims=True) / np.float32(127)
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(d == 0, 0, np.round(b / d))
    return np.concatenate([d.astype(np.float16).view(np.uint8), q.astype(np.int8).view(np.uint8)],
                          1)


def q8_scale_128(x):
    return gguf_blocks.reference_q8_0(x * np.float32(127 / 128))


def _q4(x, signed=True, interleaved=False, offset=True):
    b = x.reshape(-1, 32)
    idx = np.abs(b).argmax(1)[:, None]
    m = np.take_along_axis(b, idx, 1) if signed else np.abs(b).max(1, keepdims=True)
    d = m / np.float32(-8)
    with np.errstate(divide="ignore"):
        inv = np.where(d == 0, np.float32(0), np.float32(1) / d)
    v = b * inv + np.float32(8.5 if offset else 0)
    q = np.minimum(15, np.trunc(v)).astype(np.int8).view(np.uint8) & 0x0F
    packed = (q[:, 0::2] | q[:, 1::2] << 4) if interleaved else (q[:, :16] | q[:, 16:] << 4)
    return np.concatenate([d.astype(np.float16).view(np.uint8), packed], 1)


def test_references_pass():
    assert gguf_blocks.check_q8_0(gguf_blocks.reference_q8_0).passed
    assert gguf_blocks.check_q4_0(gguf_blocks.reference_q4_0).passed
    assert gguf_blocks.check_q4_0(_q4).passed  # the test's own correct variant agrees


@pytest.mark.parametrize("check,fn,words", [
    ("q8_0", q8_round_half_even, ["halves after scaling", "away from zero"]),
    ("q8_0", q8_scale_128, ["block 0", "max|x| / 127"]),
    ("q8_0", lambda x: np.zeros((len(x) // 32, 33), np.uint8), ["wrong type or shape"]),
    ("q4_0", lambda x: _q4(x, signed=False), ["SIGN"]),
    ("q4_0", lambda x: _q4(x, interleaved=True), ["nibble order"]),
    ("q4_0", lambda x: _q4(x, offset=False), ["+8 offset"]),
])
def test_mistakes_are_named(check, fn, words):
    result = getattr(gguf_blocks, f"check_{check}")(fn)
    assert not result.passed
    for w in words:
        assert w in result.message, result.message

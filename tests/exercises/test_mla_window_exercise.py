"""The MLA / sliding-window exercise: the reference passes, and each classic mistake is rejected
with a message naming it (RoPE on the latent, k_pe cached unrotated, W_UV absorbed on the query
side, the RoPE score term dropped, the scale forgotten, a block freed while the window still
reads it, a window off by one)."""

from __future__ import annotations

import pytest
import torch

from labkit.exercises import mla_window as M
from labkit.exercises import mla_window_solutions as S


@pytest.fixture(autouse=True)
def _progress(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_PROGRESS", str(tmp_path / "progress.json"))


def check(**kw):
    fns = {"cache_entry": S.cache_entry, "absorbed_decode": S.absorbed_decode,
           "freeable_blocks": S.freeable_blocks, **kw}
    return M.check(fns["cache_entry"], fns["absorbed_decode"], fns["freeable_blocks"])


def test_reference_passes_and_equals_the_engines_latent_decode():
    """The reference equals labkit.kv.mla's paged absorbed decode too (one block table)."""
    from labkit.kv.mla import mla_decode_absorbed

    result = check()
    assert result.passed, result.message
    mla, x, cos, sin, _ = M.layer()
    with torch.no_grad():
        q_nope, q_pe, lat = mla.project(x, cos, sin)
        T = lat.shape[1]
        cache = lat[0][:, None, :].reshape(T, 1, 1, -1)  # block_size 1: one token per block
        paged = mla_decode_absorbed(q_nope[:, -1], q_pe[:, -1], cache, torch.arange(T)[None],
                                    torch.tensor([T]), mla.w_uk(), mla.w_uv(), mla.scale)
        mine = S.absorbed_decode(q_nope[0, -1], q_pe[0, -1], lat[0], mla.w_uk(), mla.w_uv(),
                                 mla.scale)
    torch.testing.assert_close(mine, paged[0], rtol=1e-4, atol=1e-5)


def rope_everything(c, k_pe, positions, rope):
    return rope(torch.cat([c, k_pe], -1), positions)


def rope_on_latent(c, k_pe, positions, rope):
    return torch.cat([rope(c, positions), rope(k_pe, positions)], -1)


def unrotated(c, k_pe, positions, rope):
    return torch.cat([c, k_pe], -1)


def wuv_on_query_side(q_nope, q_pe, cache, w_uk, w_uv, scale):
    return S.absorbed_decode(q_nope, q_pe, cache, w_uv, w_uk, scale)


def no_rope_term(q_nope, q_pe, cache, w_uk, w_uv, scale):
    C = w_uk.shape[-1]
    return S.absorbed_decode(q_nope, torch.zeros_like(q_pe), torch.cat(
        [cache[:, :C], torch.zeros_like(cache[:, C:])], -1), w_uk, w_uv, scale)


def no_scale(q_nope, q_pe, cache, w_uk, w_uv, scale):
    return S.absorbed_decode(q_nope, q_pe, cache, w_uk, w_uv, 1.0)


def frees_the_first_token_block(n, window, bs):
    return -(-max(n - window + 1, 0) // bs)  # rounds up: frees the block the window starts in


def window_off_by_one(n, window, bs):
    return max(n - window, 0) // bs


@pytest.mark.parametrize("kw, message", [
    ({"cache_entry": rope_everything}, "you applied RoPE to the latent"),
    ({"cache_entry": rope_on_latent}, "you applied RoPE to the latent"),
    ({"cache_entry": unrotated}, "k_pe is cached unrotated"),
    ({"absorbed_decode": wuv_on_query_side}, "W_UV absorbed on the query side"),
    ({"absorbed_decode": no_rope_term}, "the RoPE term q_pe . k_pe is missing"),
    ({"absorbed_decode": no_scale}, "the softmax scale is missing"),
    ({"freeable_blocks": frees_the_first_token_block}, "still holds the window's first token"),
    ({"freeable_blocks": window_off_by_one}, "the window is off by one"),
])
def test_each_mistake_is_named(kw, message):
    result = check(**kw)
    assert not result.passed
    assert message in result.message, result.message

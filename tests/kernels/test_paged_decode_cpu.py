"""The C++ CPU paged decode kernel (labkit.kernels.paged_decode_cpu) against the plain-PyTorch
reference: grouped query heads, ragged contexts over scattered blocks, sliding windows, more
than one thread, the op a compiled graph calls, and the inputs it refuses."""

from __future__ import annotations

import pytest
import torch
from labkit.kernels.paged_attention import paged_attention_decode_ref
from labkit.kernels.paged_decode_cpu import paged_decode_cpu, supports

from labkit.engine.graph_capture import cxx_compiler
from tests.kernels.paged_fixtures import TOL, make_paged

pytestmark = pytest.mark.skipif(cxx_compiler() is None,
                                reason="no C++ compiler: the kernel is built like inductor's")


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("lens,hq,hkv,d,bs,window,nthreads", [
    ([1, 17, 40, 5], 8, 2, 32, 16, None, 1),   # labkit-tiny's heads, a 1-token context
    ([33, 9, 64], 4, 4, 64, 8, 7, 2),          # no grouping, a window, two threads
    ([50, 3, 21, 12, 8], 12, 3, 16, 4, None, 2),
    ([70, 70], 8, 1, 128, 16, 20, 1),          # multi-query, a window inside one block
])
def test_kernel_matches_the_reference(lens, hq, hkv, d, bs, window, nthreads, threads):
    threads(nthreads)
    k_cache, v_cache, tables, ctx, g = make_paged(lens, hkv, d, bs, torch.float32, seed=len(lens))
    q = torch.randn(len(lens), hq, d, generator=g)
    want = paged_attention_decode_ref(q, k_cache, v_cache, tables, ctx, d ** -0.5,
                                      sliding_window=window)
    got = paged_decode_cpu(q, k_cache, v_cache, tables, ctx, d ** -0.5, sliding_window=window)
    torch.testing.assert_close(got, want, atol=TOL[torch.float32], rtol=1e-5)
    # the op the full decode graph calls (int64 tables and lengths, no checks) agrees
    op = torch.ops.labkit.paged_decode_cpu(q, k_cache, v_cache, tables.long(), ctx.long(),
                                           d ** -0.5, window or 0)
    torch.testing.assert_close(op, got, atol=0, rtol=0)


def test_a_window_ignores_the_blocks_behind_it():
    """Keys before the window are never read: poisoning them (NaN) changes nothing, while the
    same poison inside the window does (the negative control)."""
    k_cache, v_cache, tables, ctx, g = make_paged([40], 2, 16, 8, torch.float32, seed=3)
    q = torch.randn(1, 4, 16, generator=g)
    want = paged_decode_cpu(q, k_cache, v_cache, tables, ctx, 0.25, sliding_window=10)
    first = int(tables[0, 0])  # tokens 0..7, all before the window (keys 30..39)
    k_cache[first] = float("nan")
    assert torch.equal(paged_decode_cpu(q, k_cache, v_cache, tables, ctx, 0.25,
                                        sliding_window=10), want)
    last = int(tables[0, 4])  # tokens 32..39, inside it
    k_cache[last] = float("nan")
    assert paged_decode_cpu(q, k_cache, v_cache, tables, ctx, 0.25,
                            sliding_window=10).isnan().any()


def test_bad_inputs_are_refused_before_any_pointer_is_read():
    k_cache, v_cache, tables, ctx, g = make_paged([5, 9], 2, 16, 4, torch.float32, seed=1)
    q = torch.randn(2, 4, 16, generator=g)
    with pytest.raises(ValueError, match="outside the cache"):
        paged_decode_cpu(q, k_cache, v_cache, tables + 1000, ctx, 0.25)
    with pytest.raises(ValueError, match="rows hold only"):
        paged_decode_cpu(q, k_cache, v_cache, tables, ctx + 100, 0.25)
    with pytest.raises(ValueError, match="float32"):
        paged_decode_cpu(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), tables, ctx, 0.25)
    with pytest.raises(ValueError, match="sliding_window"):
        paged_decode_cpu(q, k_cache, v_cache, tables, ctx, 0.25, sliding_window=0)
    odd = torch.zeros(2, 4, 24)
    assert "multiple of 16" in supports(odd, torch.zeros(1, 4, 2, 24))

"""Triton exercises through the CPU interpreter: reference kernels pass, classic bugs are caught,
out-of-bounds accesses are named precisely."""

import torch
import wrong_kernels as W

from labkit.exercises import solutions as S
from labkit.exercises import triton_kernels as T


def test_interpreter_selected_without_gpu():
    if not torch.cuda.is_available():
        assert T.interpreted() and T.device() == "cpu"


def test_reference_kernels_pass():
    assert T.check_vector_add(S.add_kernel).passed
    assert T.check_paged_attention(S.paged_attention_kernel).passed


def test_missing_mask_reported_as_out_of_bounds():
    msg = T.check_vector_add(W.add_kernel_no_mask).message
    assert "out-of-bounds access: load at x_ptr + 100" in msg
    assert "x_ptr has 100 elements" in msg and "mask" in msg


def test_wrong_offsets_caught():
    msg = T.check_vector_add(W.add_kernel_wrong_offset).message
    assert "wrong sum at element 256" in msg and "pid * BLOCK_SIZE" in msg


def test_paged_ignoring_block_table_caught():
    msg = T.check_paged_attention(W.paged_ignores_block_table).message
    assert "wrong output for sequence" in msg and "block_tables_ptr" in msg


def test_paged_without_context_mask_caught():
    msg = T.check_paged_attention(W.paged_no_context_mask).message
    assert "NaN" in msg and "context_len" in msg


def test_paged_without_online_softmax_rescale_caught():
    msg = T.check_paged_attention(W.paged_no_rescale).message
    assert "wrong output for sequence" in msg and "exp(m_old - m_new)" in msg


def test_untouched_stubs_read_not_implemented():
    """The kernels as the notebook ships them (a program id, then `# your code here`)."""
    import triton
    import triton.language as tl

    @triton.jit
    def add_kernel(x_ptr, y_ptr, out_ptr, n_elements, BLOCK_SIZE: tl.constexpr):
        pid = tl.program_id(0)  # noqa: F841

    @triton.jit
    def paged_attention_kernel(q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr,
                               context_lens_ptr, out_ptr, scale, max_blocks_per_seq,
                               BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr):
        seq = tl.program_id(0)  # noqa: F841

    for result in (T.check_vector_add(add_kernel), T.check_paged_attention(paged_attention_kernel)):
        assert not result.passed and result.message.startswith("·"), result.message
        assert "not implemented yet" in result.message and "stored nothing" in result.message
        assert "wrong" not in result.message


def test_bounds_checker_catches_store_past_end():
    import triton
    import triton.language as tl

    @triton.jit
    def shifted_copy(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
        offs = tl.arange(0, BLOCK)
        tl.store(out_ptr + offs + 1, tl.load(x_ptr + offs, mask=offs < n), mask=offs < n)

    x, out = T.guarded(torch.ones(8)), T.guarded(torch.zeros(8))
    try:
        with T.bounds_checked({"x_ptr": x, "out_ptr": out}):
            shifted_copy[(1,)](x, out, 8, BLOCK=8)
    except Exception as e:  # the interpreter wraps our exception
        text = T._find_oob(e)
    else:
        text = None
    assert text is not None and "store at out_ptr + 8" in text


def test_reference_decode_matches_plain_attention():
    """The checker's reference against contiguous attention on the gathered cache."""
    c = T._paged_case(5, [7, 12], 4, 8, True)
    out = T.reference_decode(c["q"], c["k_cache"], c["v_cache"], c["block_tables"],
                             c["context_lens"], c["scale"])
    for s, n in enumerate([7, 12]):
        blocks = c["block_tables"][s, : (n + 3) // 4].long()
        k = torch.cat([c["k_cache"][b] for b in blocks])[:n]
        v = torch.cat([c["v_cache"][b] for b in blocks])[:n]
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            c["q"][s][None, None, None], k[None, None], v[None, None], scale=c["scale"])
        torch.testing.assert_close(out[s], sdpa.reshape(-1), atol=1e-5, rtol=1e-5)


def test_guard_zones_catch_out_of_bounds_store_without_the_interpreter_hooks():
    """What a real GPU run relies on (no per-access checks there): a write past the end of the
    output lands in its guard zone and is reported."""
    x, y = T.guarded(torch.randn(100)), T.guarded(torch.randn(100))
    out = T.guarded(torch.zeros(100), fill=T.OUT_FILL)
    tensors = {"x_ptr": x, "y_ptr": y, "out_ptr": out}
    import pytest

    with pytest.raises(T.CheckFailure, match="wrote past the end of out_ptr"):
        T._launch(W.add_kernel_no_mask, (2,), tensors, [x, y, out, 100], {"BLOCK_SIZE": 64},
                  "n=100", check_bounds=False)
    out2 = T.guarded(torch.zeros(100), fill=T.OUT_FILL)
    T._launch(S.add_kernel, (2,), {"x_ptr": x, "y_ptr": y, "out_ptr": out2},
              [x, y, out2, 100], {"BLOCK_SIZE": 64}, "n=100", check_bounds=False)
    torch.testing.assert_close(out2, x + y)


def test_learner_kernel_serves_the_engine():
    from labkit.exercises import triton_engine

    ok = triton_engine.check_on_engine(S.paged_attention_kernel)
    assert ok.passed and "decode-attention launches" in ok.message
    bad = triton_engine.check_on_engine(W.paged_ignores_block_table)
    assert not bad.passed and "generated different tokens with your kernel" in bad.message


def test_importing_the_exercises_changes_no_environment():
    """The interpreter is chosen by an explicit ensure_interpreter() call, never as a side
    effect of an import (a fresh interpreter, TRITON_INTERPRET unset)."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = ("import os\n"
            "from labkit.exercises import inject, solutions, triton_engine, triton_kernels\n"
            "assert 'TRITON_INTERPRET' not in os.environ, 'set by an import'\n"
            "triton_kernels.ensure_interpreter()\n"
            "import torch\n"
            "assert torch.cuda.is_available() or os.environ['TRITON_INTERPRET'] == '1'\n")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]

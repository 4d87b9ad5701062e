"""``labkit.engine.compile_view``: inductor's output code captured from its log and split into
kernels and library calls. References: hand-written output modules in inductor's two formats
(C++ for a CPU, Triton for a GPU), and a real compile of a small function on this machine."""

from __future__ import annotations

import pytest
import torch

from labkit.engine.compile_view import (
    capture_output_code,
    output_code_logger,
    parse_output_code,
)
from labkit.engine.piecewise import cxx_compiler

CPU_MODULE = '''# AOT ID: ['0_inference']
async_compile = AsyncCompile()
cpp_fused_add_mean_mul_pow_rsqrt_0 = async_compile.cpp_pybinding(['const float*', 'float*'], r\'\'\'
#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(const float* in_ptr0,
                       float* out_ptr0)
{
    out_ptr0[0] = in_ptr0[0];
}
\'\'\')
cpp_fused__unsafe_view_mul_silu_1 = async_compile.cpp_pybinding(['float*'], r\'\'\'
extern "C"  void  kernel(float* in_out_ptr0)
{
}
\'\'\')
def call(args):
    extern_kernels.mm(buf0, arg1_1, out=buf1)
    cpp_fused_add_mean_mul_pow_rsqrt_0(buf1, buf2)
    extern_kernels.addmm(arg2_1, buf2, arg3_1, alpha=1, beta=1, out=buf3)
    buf4 = torch.ops.mkldnn._linear_pointwise.default(buf3, arg4_1, None, 'none', [], '')
    assert_size_stride(buf4, (8, 384), (384, 1), 'torch.ops.mkldnn._linear_pointwise.default')
'''

GPU_MODULE = '''# AOT ID: ['1_inference']
# kernel path: /tmp/torchinductor_x/ab/cab.py
triton_red_fused_add_mean_0 = async_compile.triton('triton_red_fused_add_mean_0', \'\'\'
import triton
@triton.jit
def triton_red_fused_add_mean_0(in_ptr0, out_ptr0, xnumel, r0_numel):
    pass
\'\'\', device_str='cuda')
runner = Runner(partitions=[])
call = runner.call
'''


def test_a_cpu_module_splits_into_its_kernels_and_library_calls():
    code = parse_output_code("Output code: \n" + CPU_MODULE)  # the log's header is dropped
    assert [k.name for k in code.kernels] == ["cpp_fused_add_mean_mul_pow_rsqrt_0",
                                              "cpp_fused__unsafe_view_mul_silu_1"]
    first, second = code.kernels
    assert first.language == second.language == "C++"
    assert first.source.startswith("#include") and first.source.rstrip().endswith("}")
    assert "out_ptr0[0] = in_ptr0[0];" in first.source and "mul_silu" not in first.source
    assert first.fused_ops == ["add", "mean", "mul", "pow", "rsqrt"]
    assert second.fused_ops == ["unsafe", "view", "mul", "silu"]  # the documented split
    # library GEMMs and an op called as it is (oneDNN's packed linear), not the assert's text
    assert code.library_calls == ["mm", "addmm", "mkldnn._linear_pointwise"]
    assert code.source.startswith("# AOT ID")


def test_a_gpu_module_gives_triton_kernels():
    code = parse_output_code(GPU_MODULE)
    (k,) = code.kernels
    assert (k.name, k.language, k.fused_ops) == ("triton_red_fused_add_mean_0", "Triton",
                                                 ["add", "mean"])
    assert "@triton.jit" in k.source and "device_str" not in k.source
    assert code.library_calls == []


def test_head_truncates_and_says_how_much_is_left():
    code = parse_output_code(CPU_MODULE)
    k = code.kernels[0]
    n = len(k.source.splitlines())
    assert k.head(2) == "\n".join(k.source.splitlines()[:2]) + f"\n... ({n - 2} more lines)"
    assert k.head(n) == k.source.rstrip("\n")


def test_text_that_is_not_output_code_is_refused():
    with pytest.raises(ValueError, match="not inductor output code"):
        parse_output_code("def f():\n    return 1\n")
    with pytest.raises(TypeError, match="output code is a str"):
        parse_output_code(b"call = 1")


def test_capture_keeps_distinct_modules_and_restores_the_logger():
    log = output_code_logger()
    level, handlers = log.level, list(log.handlers)
    with capture_output_code() as codes:
        for _ in range(2):  # a cache hit logs the same module again: kept once
            log.debug("Output code: \n%s", CPU_MODULE)
        log.debug("Output code written to: %s", "/tmp/x.py")  # not a module
        assert codes == []  # filled when the block ends
    assert [len(c.kernels) for c in codes] == [2]
    assert (log.level, log.handlers) == (level, handlers)
    with capture_output_code() as later:
        pass
    assert later == []  # nothing logged outside a block is kept


@pytest.mark.slow
@pytest.mark.skipif(cxx_compiler() is None, reason="inductor needs a C++ compiler on a CPU")
def test_a_real_compile_shows_the_fused_pointwise_kernel_and_the_library_gemm():
    def f(x, w, b):
        return torch.relu(x @ w + b) * 2.0

    x, w, b = torch.randn(4, 8), torch.randn(8, 16), torch.randn(16)
    compiled = torch.compile(f, backend="inductor", dynamic=False)
    with capture_output_code() as codes:
        got = compiled(x, w, b)
    torch.testing.assert_close(got, f(x, w, b), rtol=1e-5, atol=1e-6)
    assert len(codes) == 1
    (code,) = codes
    # the add, relu and mul after the GEMM are one generated loop; the GEMM is a library call
    assert {"mm", "addmm", "mkldnn._linear_pointwise"} & set(code.library_calls)
    fused = [k for k in code.kernels if "relu" in k.fused_ops]
    assert fused and fused[0].language == "C++" and 'extern "C"' in fused[0].source

"""``labkit bench kernels-static``: what the compiler made of each Triton kernel, no GPU needed.

Triton compiles to PTX and then to a Hopper (sm_90) cubin on any machine. The cubin says how
many registers a thread needs (which caps how many warps an SM keeps in flight to hide memory
latency) and which machine instructions (SASS) the hot loop runs. For the decode GEMV kernels
the loop cost per weight is the number that matters: 4-bit weights stream at ~9.6 T weights/s
on an H200, and in that time its SMs issue only ~3.5 instructions per thread per weight
(``issue_budget_per_weight``), so a loop that needs more than that is issue-bound, not
memory-bound. These are static counts, not timings: ``labkit bench kernels``
measures on a GPU.

The compile mimics a real launch: pointers 16-byte aligned and sizes divisible by 16 are
specialised the way Triton's JIT does it, so loads vectorise as they would on the device.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from labkit.bench.common import bench_parser, print_table, write_json
from labkit.paths import RESULTS_DIR

DEFAULT_JSON = RESULTS_DIR / "kernels_static.json"
REGS_PER_SM, MAX_WARPS_PER_SM = 65536, 64
# Hopper (sm_90): 64K 32-bit registers and at most 64 resident warps per SM (CUDA C++
# Programming Guide, "Technical Specifications per Compute Capability", 9.0); each SM has four
# warp schedulers issuing one warp instruction (32 threads) per clock; an H200 (GH100, like the
# H100 SXM5) has 132 SMs at up to 1.98 GHz (NVIDIA H100 Tensor Core GPU Architecture
# whitepaper, 2022; https://www.nvidia.com/en-us/data-center/h200/).
ISSUE_THREADS_PER_SM_CLOCK, H200_SMS, H200_MAX_CLOCK_HZ = 4 * 32, 132, 1.98e9

DIV16 = {"N", "K", "stride_xm", "stride_om", "split_stride"}
INT4 = {"x_ptr": "*fp16", "qw_ptr": "*i32", "qz_ptr": "*i32", "s_ptr": "*fp16",
        "g_ptr": "*i32", "out_ptr": "*fp32"}


def issue_budget_per_weight(bits: int = 4) -> float:
    """Instructions per thread the H200's SMs can issue in the time one ``bits``-bit weight
    streams in at its datasheet bandwidth (4.8 TB/s): the most SASS per weight (``sass_per_weight``)
    a decode GEMV loop can run and still be limited by memory rather than by instruction issue."""
    from labkit.sim.presets import get_gpu

    weights_per_s = get_gpu("h200-sxm").mem_bandwidth * 8 / bits
    return ISSUE_THREADS_PER_SM_CLOCK * H200_SMS * H200_MAX_CLOCK_HZ / weights_per_s


def compile_sm90(fn, ptr_types: dict[str, str], consts: dict[str, Any], num_warps: int,
                 num_stages: int = 3):
    """Compile ``fn`` for sm_90 with the JIT's usual specialisations (see module doc)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in consts:
            sig[name], constexprs[(i,)] = "constexpr", consts[name]
            continue
        sig[name] = ptr_types.get(name, "i32")
        if sig[name].startswith("*") or name in DIV16:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return triton.compile(ASTSource(fn, sig, constexprs, attrs), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def _cuobjdump(args: list[str], cubin: bytes) -> str:
    import triton.knobs

    tool = triton.knobs.nvidia.cuobjdump.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, *args, f.name], capture_output=True, text=True,
                              check=True).stdout


def resources(cubin: bytes) -> dict[str, int]:
    """Registers per thread, spill (local) bytes and static shared memory, from the cubin."""
    out = _cuobjdump(["-res-usage"], cubin)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if m is None:
        raise RuntimeError(f"cuobjdump -res-usage gave no resource line:\n{out}")
    return {"registers": int(m[1]), "stack": int(m[2]), "shared": int(m[3]), "local": int(m[4])}


def inner_loop(cubin: bytes) -> list[str]:
    """SASS of the innermost hot loop: the smallest backward branch's body that has FFMAs."""
    ins = []
    for line in _cuobjdump(["-sass"], cubin).splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append((int(m[1], 16), m[2].strip()))
    loops = []
    for addr, text in ins:
        target = re.search(r"BRA\b.*?0x([0-9a-f]+)", text)
        if target and int(target[1], 16) < addr:
            body = [t for a, t in ins if int(target[1], 16) <= a <= addr]
            if any("FFMA" in t for t in body):
                loops.append(body)
    return min(loops, key=len) if loops else []


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def analyse(name: str, kernel, weights_per_iter: int | None, num_warps: int) -> dict[str, Any]:
    cubin = kernel.asm["cubin"]
    res = resources(cubin)
    regs = -(-res["registers"] // 8) * 8  # allocated in units of 8 per thread
    ctas = min(REGS_PER_SM // (regs * 32 * num_warps), MAX_WARPS_PER_SM // num_warps)
    loop = inner_loop(cubin)
    mix = Counter(opcode(t) for t in loop)
    row = {"kernel": name, **res, "warps_per_sm": ctas * num_warps,
           "loop_sass": len(loop), "loop_mix": dict(mix.most_common(8)),
           "loop_barriers": mix.get("BAR", 0)}
    if weights_per_iter:
        row["sass_per_weight"] = len(loop) / weights_per_iter
    return row


def cases():
    """(label, kernel fn, pointer types, constexprs, warps, weights per thread per loop trip)."""
    from labkit.kernels import dequant_gemv as gv
    from labkit.kernels import dequant_matmul as dq
    from labkit.kernels import paged_attention as pa

    for kind, fn, types, extra in (
            ("gptq", gv._gptq_gemv_kernel, INT4, {"GROUP_SIZE": 128}),
            ("gptq act-order", gv._gptq_gemv_kernel, INT4, {"GROUP_SIZE": 0}),
            ("awq", gv._awq_gemv_kernel, INT4, {"GROUP_SIZE": 128}),
            ("w8a16", gv._w8a16_gemv_kernel, {**INT4, "qw_ptr": "*i8"}, {})):
        cfg = dq.default_config(1, 8192, 8192, kind.split()[0])
        bn, bk, w = cfg["BLOCK_N"], cfg["BLOCK_K"], cfg["num_warps"]
        yield (f"{kind} GEMV M=1 BLOCK_N={bn} BLOCK_K={bk} warps={w}", fn, types,
               {**extra, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT": True}, w, bn * bk // (32 * w))
    attn = {"out_ptr": "*bf16", "q_ptr": "*bf16", "k_cache_ptr": "*bf16",
            "v_cache_ptr": "*bf16", "block_tables_ptr": "*i32", "context_lens_ptr": "*i32",
            "lse_ptr": "*fp32", "k_scale_ptr": "*fp16", "v_scale_ptr": "*fp16",
            "sinks_ptr": "*fp32"}  # typed even when unused: their branches are compiled out
    yield ("paged_attention_decode Hq/Hkv=4 D=128 bs=16 BLOCK_N=64", pa._paged_decode_kernel,
           attn, {"QUERY_GROUP": 4, "GROUP_PAD": 16, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128,
                  "BLOCK_SIZE": 16, "BLOCK_N": 64, "SPLIT": False, "DOT_FP32": False,
                  "PRECISION": "tf32", "WINDOWED": False, "HAS_SINKS": False}, 4, None)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("kernels-static", __doc__.splitlines()[0])
    args = p.parse_args(argv)
    from labkit.kernels._common import interpreting

    if interpreting():
        print("labkit bench kernels-static compiles with the real Triton compiler: unset "
              "TRITON_INTERPRET (the interpreter replaces @triton.jit functions).",
              file=sys.stderr)
        return 2
    rows, errors = [], []
    for label, fn, types, consts, warps, wpi in cases():
        try:
            rows.append(analyse(label, compile_sm90(fn, types, consts, warps), wpi, warps))
        except Exception as e:  # noqa: BLE001 - report each kernel, keep going
            errors.append({"kernel": label, "error": repr(e)[:300]})
            print(f"{label}: FAILED {e!r}", file=sys.stderr)
    print_table(rows, ["kernel", "registers", "local", "warps_per_sm", "loop_sass",
                       "sass_per_weight", "loop_barriers"])
    write_json(Path(args.json) if args.json else DEFAULT_JSON,
               {"target": "sm_90 (static, no GPU)", "results": rows, "errors": errors})
    return 1 if errors else 0

"""Compile every kernel's GPU variants for Hopper (sm_90) with the real Triton compiler.

No GPU is needed: Triton lowers to PTX and runs its bundled ptxas. This catches what the CPU
interpreter cannot (globals that are not constexpr, layouts the GPU backend rejects, shared
memory beyond an SM's 227 KB). Run as a script *without* TRITON_INTERPRET (the interpreter
replaces @triton.jit functions); ``test_compile_sm90.py`` does that in a subprocess.
Prints one line per variant and exits non-zero if any failed.
"""

import sys

from labkit.kernels import dequant_gemv as gv
from labkit.kernels import dequant_matmul as dq
from labkit.kernels import fused_moe as fm
from labkit.kernels import lora_ops as lo
from labkit.kernels import mla_decode as md
from labkit.kernels import nf4, paged_attention, paged_prefill, rms_norm, rotary_embedding
from labkit.kernels import reshape_and_cache as rc

from labkit.bench.kernels_static import compile_sm90

SMEM_LIMIT = 227 * 1024
BF16_ATTN = {"out_ptr": "*bf16", "q_ptr": "*bf16", "k_cache_ptr": "*bf16", "v_cache_ptr": "*bf16",
             "block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "lse_ptr": "*fp32",
             "query_start_loc_ptr": "*i32", "k_scale_ptr": "*fp16", "v_scale_ptr": "*fp16",
             "sinks_ptr": "*bf16"}
ATTN = {"QUERY_GROUP": 4, "HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "BLOCK_SIZE": 16,
        "DOT_FP32": False, "PRECISION": "tf32", "WINDOWED": False, "HAS_SINKS": False}
# INT8 KV cache (the kernels branch on the cache's int8 element type at compile time):
# int8 codes, fp16 per-(token, head) scales, bf16 queries
INT8_ATTN = {**BF16_ATTN, "k_cache_ptr": "*i8", "v_cache_ptr": "*i8"}
# FP8 (e4m3) KV cache: its bytes as uint8 (kernels/fp8_kv.py decodes them by hand)
FP8_ATTN = {**BF16_ATTN, "k_cache_ptr": "*u8", "v_cache_ptr": "*u8"}


def variants():
    yield paged_attention._paged_decode_kernel, BF16_ATTN, {
        **ATTN, "GROUP_PAD": 16, "BLOCK_N": 64, "SPLIT": False}, 4, 2
    yield paged_attention._paged_decode_kernel, {**BF16_ATTN, "out_ptr": "*fp32"}, {
        **ATTN, "GROUP_PAD": 16, "BLOCK_N": 64, "SPLIT": True}, 4, 2
    for split in (False, True):
        yield paged_attention._paged_decode_kernel, {
            **INT8_ATTN, "out_ptr": "*fp32" if split else "*bf16"}, {
            **ATTN, "GROUP_PAD": 16, "BLOCK_N": 64, "SPLIT": split}, 4, 2
    yield paged_attention._merge_splits_kernel, {"out_ptr": "*bf16", "part_ptr": "*fp32",
                                                 "lse_ptr": "*fp32"}, {
        "HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "SPLITS_PAD": 32, "HAS_SINKS": False}, 4, 1
    for bm, bn, warps in ((64, 64, 4), (16, 64, 4), (128, 128, 8)):
        yield paged_prefill._paged_prefill_kernel, BF16_ATTN, {
            **ATTN, "BLOCK_M": bm, "BLOCK_N": bn}, warps, 2
    for bm in (16, 64):
        yield paged_prefill._paged_prefill_kernel, INT8_ATTN, {
            **ATTN, "BLOCK_M": bm, "BLOCK_N": 64}, 4, 2
    # sliding-window layers (Mistral, Qwen2, Gemma 3): the window's loop bounds and masks
    win = {**ATTN, "WINDOWED": True}
    for split in (False, True):
        yield paged_attention._paged_decode_kernel, {
            **BF16_ATTN, "out_ptr": "*fp32" if split else "*bf16"}, {
            **win, "GROUP_PAD": 16, "BLOCK_N": 64, "SPLIT": split}, 4, 2
    for types in (BF16_ATTN, INT8_ATTN):
        yield paged_prefill._paged_prefill_kernel, types, {**win, "BLOCK_M": 64, "BLOCK_N": 64}, \
            4, 2
    # FP8 caches, and gpt-oss's sinks (with its sliding layers) over float and FP8 caches
    sinks = {**ATTN, "HAS_SINKS": True}
    for types, extra in ((FP8_ATTN, ATTN), (BF16_ATTN, sinks), (FP8_ATTN, sinks)):
        for split in (False, True):
            yield paged_attention._paged_decode_kernel, {
                **types, "out_ptr": "*fp32" if split else "*bf16"}, {
                **extra, "WINDOWED": split, "GROUP_PAD": 16, "BLOCK_N": 64, "SPLIT": split}, 4, 2
        yield paged_prefill._paged_prefill_kernel, types, {
            **extra, "WINDOWED": True, "BLOCK_M": 64, "BLOCK_N": 64}, 4, 2
    yield paged_attention._merge_splits_kernel, {"out_ptr": "*bf16", "part_ptr": "*fp32",
                                                 "lse_ptr": "*fp32", "sinks_ptr": "*bf16"}, {
        "HEAD_DIM": 128, "HEAD_DIM_PAD": 128, "SPLITS_PAD": 32, "HAS_SINKS": True}, 4, 1
    # head_dim 256 in fp32 (fp32 models, Gemma-sized heads): the largest tiles the fuzz tests
    # run; prefill's default 64 x 64 tile needs ~213 KB of shared memory here
    fp32 = {k: v.replace("bf16", "fp32") for k, v in BF16_ATTN.items()}
    d256 = {**ATTN, "HEAD_DIM": 256, "HEAD_DIM_PAD": 256, "PRECISION": "ieee"}
    yield paged_attention._paged_decode_kernel, fp32, {
        **d256, "GROUP_PAD": 16, "BLOCK_N": 32, "SPLIT": True}, 4, 2
    yield paged_prefill._paged_prefill_kernel, fp32, {**d256, "BLOCK_M": 64, "BLOCK_N": 64}, 4, 2
    # absorbed MLA decode at DeepSeek-V3's shapes: 128 heads in blocks of 64 (and 16), a latent
    # of 512 + a rotary key of 64 per token, blocks of 16 tokens
    mla_types = {"out_ptr": "*fp32", "q_lat_ptr": "*bf16", "q_pe_ptr": "*bf16",
                 "cache_ptr": "*bf16", "block_tables_ptr": "*i32", "context_lens_ptr": "*i32"}
    for bh, warps in ((64, 8), (16, 4)):
        yield md._mla_decode_kernel, mla_types, {
            "NUM_HEADS": 128, "BLOCK_H": bh, "RANK": 512, "RANK_PAD": 512, "ROPE": 64,
            "ROPE_PAD": 64, "BLOCK_SIZE": 16, "BLOCK_N": 16, "DOT_FP32": False,
            "PRECISION": "tf32"}, warps, 1
    rc_types = {"key_ptr": "*bf16", "value_ptr": "*bf16", "k_cache_ptr": "*bf16",
                "v_cache_ptr": "*bf16", "slot_mapping_ptr": "*i64", "k_scale_ptr": "*fp16",
                "v_scale_ptr": "*fp16"}
    rc_consts = {"NUM_HEADS": 8, "HEAD_DIM": 128, "HEADS_PAD": 8, "DIM_PAD": 128,
                 "BLOCK_SIZE": 16}
    yield rc._reshape_and_cache_kernel, rc_types, rc_consts, 4, 1
    for code in ("*i8", "*u8"):  # INT8 and FP8 (e4m3 bytes) caches
        yield rc._reshape_and_cache_kernel, {**rc_types, "k_cache_ptr": code,
                                             "v_cache_ptr": code}, rc_consts, 4, 1
    yield rms_norm._rms_norm_kernel, {"out_ptr": "*bf16", "res_out_ptr": "*bf16",
                                      "x_ptr": "*bf16", "res_ptr": "*bf16", "w_ptr": "*bf16",
                                      "eps": "fp32"}, {"HAS_RESIDUAL": True, "BLOCK": 4096}, 8, 1
    yield rotary_embedding._rotary_kernel, {"q_ptr": "*bf16", "k_ptr": "*bf16",
                                            "pos_ptr": "*i64", "cache_ptr": "*fp32"}, {
        "QH_PAD": 32, "KH_PAD": 8, "HALF": 64, "HALF_PAD": 64}, 4, 1
    yield nf4._nf4_kernel, {"out_ptr": "*fp16", "packed_ptr": "*u8", "absmax_ptr": "*fp32",
                            "code_ptr": "*fp32"}, {"BLOCK": 1024}, 4, 1
    int4 = {"x_ptr": "*fp16", "qw_ptr": "*i32", "qz_ptr": "*i32", "s_ptr": "*fp16",
            "g_ptr": "*i32", "out_ptr": "*fp32"}
    for m in (16, 128):
        cfg = dq.default_config(m, 4096, 4096)
        tiles = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
        for group in (128, 0):
            yield dq._gptq_kernel, int4, {**tiles, "GROUP_SIZE": group, "SPLIT": True,
                                          "DOT_FP32": False}, cfg["num_warps"], 3
        yield dq._awq_kernel, {**int4, "out_ptr": "*bf16", "x_ptr": "*bf16"}, {
            **tiles, "GROUP_SIZE": 128, "SPLIT": False, "DOT_FP32": False}, cfg["num_warps"], 3
        yield dq._w8a16_kernel, {**int4, "qw_ptr": "*i8"}, {
            **tiles, "SPLIT": True, "DOT_FP32": False}, cfg["num_warps"], 3
    gemv = {kind: dq.default_config(1, 4096, 4096, kind) for kind in ("gptq", "awq", "w8a16")}
    tiles = {kind: {k: c[k] for k in ("BLOCK_N", "BLOCK_K")} for kind, c in gemv.items()}
    for group in (128, 0):  # the decode GEMV kernels (M = 1)
        yield gv._gptq_gemv_kernel, int4, {**tiles["gptq"], "GROUP_SIZE": group,
                                           "SPLIT": True}, gemv["gptq"]["num_warps"], 3
    yield gv._awq_gemv_kernel, {**int4, "out_ptr": "*bf16", "x_ptr": "*bf16"}, {
        **tiles["awq"], "GROUP_SIZE": 128, "SPLIT": False}, gemv["awq"]["num_warps"], 3
    yield gv._w8a16_gemv_kernel, {**int4, "qw_ptr": "*i8"}, {
        **tiles["w8a16"], "SPLIT": True}, gemv["w8a16"]["num_warps"], 3
    yield dq._sum_splits, {"out_ptr": "*fp16", "ws_ptr": "*fp32"}, {"BLOCK": 1024}, 4, 1
    yield from moe_lora_variants()


def moe_lora_variants():
    """fused_moe's two passes at both tile configs; the LoRA kernels at ranks 16 and 64."""
    moe = {"a_ptr": "*bf16", "w_ptr": "*bf16", "c_ptr": "*bf16", "topk_w_ptr": "*fp32",
           "sorted_ids_ptr": "*i64", "expert_ids_ptr": "*i64", "ntpp_ptr": "*i64"}
    for num_pairs in (8, 4096):  # decode (BLOCK_M 16) and prefill (BLOCK_M 64) of 8 experts
        cfg = fm.default_config(num_pairs, 8)
        tiles = {k: cfg[k] for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K")}
        for gated in (True, False):  # gate|up + SiLU into bf16; down + weight into fp32
            yield fm._grouped_gemm_kernel, {**moe, "c_ptr": "*bf16" if gated else "*fp32"}, {
                **tiles, "TOP_K": 2 if gated else 1, "GATED": gated,
                "MUL_ROUTED_WEIGHT": not gated, "DOT_FP32": False, "PRECISION": "tf32"}, \
                cfg["num_warps"], 3
    lora = {"x_ptr": "*bf16", "a_ptr": "*bf16", "out_ptr": "*fp32", "slots_ptr": "*i64",
            "y_ptr": "*bf16", "buf_ptr": "*fp32", "b_ptr": "*bf16", "scal_ptr": "*fp32",
            "starts_ptr": "*i64"}
    dot = {"DOT_FP32": False, "PRECISION": "tf32"}
    for r_pad in (16, 64):
        yield lo._bgmv_shrink_kernel, lora, {"R_PAD": r_pad, "BLOCK_K": 4096 // r_pad,
                                             "SPLIT_K": 8}, 4, 1
        yield lo._bgmv_expand_kernel, lora, {"R_PAD": r_pad, "BLOCK_N": 4096 // r_pad}, 4, 1
        yield lo._sgmv_shrink_kernel, lora, {"R_PAD": r_pad, "BLOCK_M": 64, "BLOCK_K": 64,
                                             **dot}, 4, 3
        yield lo._sgmv_expand_kernel, lora, {"R_PAD": r_pad, "BLOCK_M": 64, "BLOCK_N": 64,
                                             **dot}, 4, 1


GROUPS = ("attention", "quant", "small", "moe_lora")


def _group(fn) -> str:
    """Which of the test's four parts compiles ``fn`` (one subprocess each, so pytest -n 2
    balances ~45 compilations across its workers instead of one worker doing all of them)."""
    if fn in (paged_attention._paged_decode_kernel, paged_attention._merge_splits_kernel,
              paged_prefill._paged_prefill_kernel, md._mla_decode_kernel):
        return "attention"
    if fn in (dq._gptq_kernel, dq._awq_kernel, dq._w8a16_kernel, dq._sum_splits,
              gv._gptq_gemv_kernel, gv._awq_gemv_kernel, gv._w8a16_gemv_kernel):
        return "quant"
    if fn in (fm._grouped_gemm_kernel, lo._bgmv_shrink_kernel, lo._bgmv_expand_kernel,
              lo._sgmv_shrink_kernel, lo._sgmv_expand_kernel):
        return "moe_lora"
    return "small"


def main(group: str | None = None) -> int:
    failed = 0
    for fn, types, consts, warps, stages in variants():
        if group is not None and _group(fn) != group:
            continue
        label = f"{fn.__name__} {types.get('k_cache_ptr', '')} {consts}".replace("  ", " ")
        try:
            kernel = compile_sm90(fn, types, consts, warps, stages)
            smem = kernel.metadata.shared
            ok = smem <= SMEM_LIMIT
            if fn is rc._reshape_and_cache_kernel and types["k_cache_ptr"] in ("*i8", "*u8"):
                # bit-exact INT8 / FP8 codes need IEEE division (div_rn), not the GPU's fast
                # one; the interpreter divides exactly either way, so only the PTX can show it
                ptx = kernel.asm["ptx"]
                ok &= "div.rn.f32" in ptx and "div.full.f32" not in ptx \
                    and "div.approx" not in ptx
            print(f"{'ok' if ok else 'FAIL'} {label} shared={smem}")
            failed += not ok
        except Exception as e:  # noqa: BLE001 - report every variant
            print(f"FAIL {label}: {e!r}"[:400])
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))

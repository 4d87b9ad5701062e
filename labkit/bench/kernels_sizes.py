"""The sizes ``labkit bench kernels`` runs at: the issue's shapes (FULL), the headline ones
(QUICK, ~1 minute), toy ones the tests drive on CPU (SMOKE), and the dequant tile sweep."""

from __future__ import annotations

FULL = {
    "copy_bytes": 2 << 30,
    "decode": [(b, c) for b in (1, 16, 64) for c in (512, 4096, 16384)],
    "heads": (32, 8, 128), "block_size": 16,
    "prefill": [(4, 1024, 1024), (1, 4096, 4096), (4, 512, 4096)],  # seqs, q_len, ctx_len
    "dequant": [(m, k) for k in (4096, 8192) for m in (1, 16, 128)],
    "group_size": 128, "nf4": (8192, 8192), "cache_tokens": 8192, "norm": (8192, 4096),
    "check": {"decode": (16, 4096), "prefill": (3, 300, 1000), "dequant": (16, 4096)},
    "tune_decode": (64, 4096), "tune_prefill": (1, 4096),
    "decode_configs": [(32, 4, 3), (128, 4, 2), (64, 8, 3), (128, 8, 3), (64, 4, 4), (128, 4, 3)],
    "prefill_configs": [(128, 64, 8, 2), (128, 64, 8, 3), (64, 128, 4, 2), (128, 128, 8, 2),
                        (64, 64, 4, 3)],
}
# --quick: the headline shapes only (the two targets plus one of each kernel), ~1 minute.
QUICK = {**FULL, "decode": [(1, 16384), (64, 4096)], "prefill": [(1, 4096, 4096)],
         "dequant": [(1, 8192)], "decode_configs": [], "prefill_configs": []}
# Tiny sizes: lets the tests drive every code path on CPU under the interpreter.
SMOKE = {
    "copy_bytes": 1 << 16, "decode": [(2, 40)], "heads": (4, 2, 16), "block_size": 16,
    "prefill": [(2, 20, 20), (1, 8, 40)], "dequant": [(1, 64), (16, 64)], "group_size": 32,
    "nf4": (8, 64), "cache_tokens": 16, "norm": (4, 64),
    "check": {"decode": (2, 40), "prefill": (2, 9, 30), "dequant": (3, 64)},
    "tune_decode": (2, 40), "tune_prefill": (1, 20), "decode_configs": [(32, 4, 3)],
    "prefill_configs": [(32, 32, 4, 2)],
}
# Extra tile configs tried for the small-M dequant cases; the best is reported with its config.
SWEEP = {
    # M = 1 runs the GEMV kernels (kernels/dequant_gemv.py); the first two are the GPTQ/W8A16
    # and the AWQ defaults. Static sm_90 counts for the GPTQ default: 64 registers (8 CTAs/SM),
    # ~5.9 SASS instructions per weight in the loop; the device decides which is fastest.
    1: [{"BLOCK_M": 1, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 4},
        {"BLOCK_M": 1, "BLOCK_N": 128, "BLOCK_K": 32, "SPLIT_K": 4, "num_warps": 4},
        {"BLOCK_M": 1, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 2, "num_warps": 4},
        {"BLOCK_M": 1, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 2, "num_warps": 4,
         "num_stages": 4},
        {"BLOCK_M": 1, "BLOCK_N": 256, "BLOCK_K": 32, "SPLIT_K": 4, "num_warps": 4},
        {"BLOCK_M": 1, "BLOCK_N": 64, "BLOCK_K": 64, "SPLIT_K": 8, "num_warps": 4}],
    16: [{"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 4},
         {"BLOCK_M": 16, "BLOCK_N": 128, "BLOCK_K": 128, "SPLIT_K": 2, "num_warps": 4},
         {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 128, "SPLIT_K": 4, "num_warps": 4}],
    128: [{"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 8},
          {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "SPLIT_K": 1, "num_warps": 4}],
}

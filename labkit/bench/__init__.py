"""Benchmarks behind ``labkit bench NAME``: each module has ``main(argv) -> int``.

Every benchmark compares alternatives side by side in one run and reports ratios; absolute
times are printed only as context (and only trusted on a GPU).
"""

BENCHMARKS = {
    "memory": "labkit.bench.memory",
    "batching": "labkit.bench.batching",
    "prefix": "labkit.bench.prefix",
    "kernels": "labkit.bench.kernels",
    "kernels-static": "labkit.bench.kernels_static",
    "quant": "labkit.bench.quant",
    "spec": "labkit.bench.spec",
    "lora": "labkit.bench.lora",
    "lora-router": "labkit.bench.lora_router",
    "qlora": "labkit.bench.qlora",
    "serve": "labkit.bench.serve",
    "serve-soak": "labkit.bench.serve_soak",
    "serve-llamacpp": "labkit.bench.serve_llamacpp",
    "cluster": "labkit.bench.cluster",
    "compress": "labkit.bench.compress",
    "gguf": "labkit.bench.gguf",
    "engine-gpu": "labkit.bench.engine_gpu",
    "lm-eval": "labkit.bench.lm_eval_quant",
    "moe": "labkit.bench.moe",
    "disagg": "labkit.bench.disagg",
    "kv-offload": "labkit.bench.kv_offload",
    "disagg-sim": "labkit.bench.disagg_sim",
    "ops": "labkit.bench.ops",
    "step": "labkit.bench.step",
    "step-gpu": "labkit.bench.step_gpu",
    "kv-formats": "labkit.bench.kv_formats",
}

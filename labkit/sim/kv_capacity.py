"""How many concurrent long requests fit on a GPU: the question a 2026 model's KV layout answers.

Weights come off the top; what is left of ``gpu_memory_utilization`` of the GPU's memory (vLLM's
default 0.9) holds KV, and each request of ``context_len`` tokens needs
:meth:`ModelPreset.kv_bytes` of it: full layers hold every token, a sliding layer only its
window (when the cache frees what falls out of it; ``free_sliding=False`` is a cache that keeps
everything, as one block table per sequence must for a model that mixes full and sliding
layers), MLA layers one latent per token. Tokens are counted exactly; a paged cache rounds each
sequence up to whole blocks, less than one block per layer group more. Activations and CUDA
graphs are left out (vLLM profiles them; a few GiB), so these are upper bounds.
"""

from __future__ import annotations

from labkit.sim.presets import GPUPreset, ModelPreset, get_gpu, get_model_preset

__all__ = ["CAPACITY_MODELS", "capacity_table", "max_concurrent_requests"]

CAPACITY_MODELS = ("llama-3-8b", "qwen3-32b", "gemma-3-27b", "gpt-oss-120b", "deepseek-v3")


def request_kv_bytes(model: str | ModelPreset, context_len: int, tp: int = 1,
                     free_sliding: bool = True) -> int:
    """KV bytes one request of ``context_len`` tokens holds on one of ``tp`` GPUs."""
    m = get_model_preset(model)
    if context_len < 1:
        raise ValueError(f"context_len must be >= 1, got {context_len}")
    if free_sliding:
        return m.kv_bytes(context_len, tp)
    return m.kv_bytes_per_token_per_gpu(tp) * context_len


def max_concurrent_requests(model: str | ModelPreset, gpu: str | GPUPreset = "h200-sxm",
                            context_len: int = 32768, gpu_memory_utilization: float = 0.9,
                            tp: int = 1, free_sliding: bool = True) -> int:
    """Requests of ``context_len`` tokens whose KV fits beside the weights (split over ``tp``
    GPUs); 0 when the weights alone do not fit (DeepSeek-V3 on one H200)."""
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                         f"{gpu_memory_utilization}")
    if tp < 1:
        raise ValueError(f"tp must be >= 1, got {tp}")
    m, g = get_model_preset(model), get_gpu(gpu)
    budget = g.mem_bytes * gpu_memory_utilization - m.weight_bytes / tp
    if budget <= 0:
        return 0
    return int(budget // request_kv_bytes(m, context_len, tp, free_sliding))


def capacity_table(models: tuple[str, ...] = CAPACITY_MODELS, gpu: str = "h200-sxm",
                   context_len: int = 32768, tp: int = 1) -> list[dict]:
    """One row per model: weights, KV per request with and without freeing sliding layers,
    and how many requests fit either way."""
    rows = []
    for name in models:
        m = get_model_preset(name)
        rows.append({
            "model": m.name, "gpu": get_gpu(gpu).name, "context_len": context_len, "tp": tp,
            "weight_gib": m.weight_bytes / tp / 2**30,
            "kv_gib_per_request": request_kv_bytes(m, context_len, tp) / 2**30,
            "kv_gib_per_request_no_freeing": request_kv_bytes(m, context_len, tp, False) / 2**30,
            "max_requests": max_concurrent_requests(m, gpu, context_len, tp=tp),
            "max_requests_no_freeing": max_concurrent_requests(m, gpu, context_len, tp=tp,
                                                               free_sliding=False),
        })
    return rows

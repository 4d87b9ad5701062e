"""A roofline cost model for one engine step: how long a named GPU takes to run a named model.

Why a roofline is enough to reproduce serving behaviour: every step of a continuous-batching engine
multiplies the batch's new tokens by every weight matrix once. The work is ``2 · params`` FLOPs per
token (a multiply and an add per weight) plus attention, while the bytes are the weights, read once
per step no matter how many tokens share them, plus the KV cache each query reads. So

    compute_s = (2 · params · new_tokens + 4 · layers · q_heads · head_dim · attention_pairs) / peak
    memory_s  = (weight_bytes + kv_bytes_per_token · (context_tokens + new_tokens)) / bandwidth
    step_s    = max(compute_s, memory_s) + STEP_OVERHEAD_S

A decode step (one token per sequence) has ~1 FLOP per weight byte per sequence, far under the
GPU's ridge point (~150 FLOP/byte on an A100), so it is memory-bound: batch 1 costs the same as
batch 64 until KV reads or compute catch up — the whole reason batching pays. A prefill of a few
hundred tokens crosses the ridge and becomes compute-bound. Phases mixed in one step (chunked
prefill) share the single weight read, which is why piggybacking decodes on a prefill is cheap.

Simplifications (stated so a learner can argue with them): peaks are datasheet peaks (real kernels
reach ~60-80% of FLOP/s and ~80-90% of bandwidth); ``2 · params`` counts the embedding table as a
matmul and runs ``lm_head`` on every token (a few % too many FLOPs for prefill); activations are
not counted as memory traffic. For a mixture of experts ``params`` is the active count (top-k
experts) and the weight bytes are the experts the step's tokens touch (``weight_bytes_read``:
about the active weights at batch 1, all of them at a few hundred tokens). ``STEP_OVERHEAD_S``
= 0.5 ms stands for the per-step CPU work (scheduling, input preparation, sampling, kernel
launches) that a CUDA-graph-captured engine such as vLLM keeps to a few hundred µs to ~1 ms.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.sim.presets import GPUPreset, ModelPreset, get_gpu, get_model_preset

STEP_OVERHEAD_S = 0.5e-3


@dataclass(frozen=True)
class StepCost:
    """The pieces of one step's time, so widgets can show which roof a step hit."""

    flops: float
    bytes: float
    compute_s: float
    memory_s: float
    overhead_s: float

    @property
    def time_s(self) -> float:
        return max(self.compute_s, self.memory_s) + self.overhead_s

    @property
    def bound(self) -> str:
        return "compute" if self.compute_s >= self.memory_s else "memory"


def attention_pairs(start_pos: int, num_tokens: int) -> int:
    """(query, key) pairs one sequence's chunk computes under causal attention.

    The chunk's tokens sit at positions ``start_pos .. start_pos + num_tokens - 1``; token ``i``
    attends to ``start_pos + i + 1`` keys. A decode step is ``num_tokens = 1``."""
    if start_pos < 0 or num_tokens < 0:
        raise ValueError(f"start_pos and num_tokens must be >= 0, got {start_pos}, {num_tokens}")
    return num_tokens * start_pos + num_tokens * (num_tokens + 1) // 2


def step_cost(
    model: ModelPreset | str,
    gpu: GPUPreset | str,
    num_prefill_tokens: int,
    num_decode_tokens: int,
    context_tokens: int,
    *,
    attention_pairs: int | None = None,
    overhead_s: float = STEP_OVERHEAD_S,
) -> StepCost:
    """Roofline cost of one step; see the module docstring for the formulas.

    ``context_tokens``: KV entries the step's attention reads, i.e. the sum over scheduled
    sequences of their context length before this step (cached prompt + generated tokens).
    ``attention_pairs``: exact causal (query, key) pairs, the sum of :func:`attention_pairs` over
    scheduled chunks; if None it is estimated as ``context_tokens + new_tokens`` (exact when every
    sequence decodes one token) plus ``P²/2`` for the prefill tokens ``P`` (exact for one prompt).
    """
    m, g = get_model_preset(model), get_gpu(gpu)
    for label, v in (("num_prefill_tokens", num_prefill_tokens),
                     ("num_decode_tokens", num_decode_tokens), ("context_tokens", context_tokens)):
        if v < 0:
            raise ValueError(f"{label} must be >= 0, got {v}")
    new_tokens = num_prefill_tokens + num_decode_tokens
    if new_tokens == 0:
        return StepCost(0.0, 0.0, 0.0, 0.0, 0.0)
    if attention_pairs is None:
        attention_pairs = context_tokens + new_tokens + num_prefill_tokens**2 // 2
    flops = 2.0 * m.active_params * new_tokens
    flops += 4.0 * m.num_layers * m.num_heads * m.head_dim * attention_pairs
    nbytes = m.weight_bytes_read(new_tokens) + m.kv_bytes_per_token * (context_tokens + new_tokens)
    return StepCost(flops, nbytes, flops / g.peak_flops, nbytes / g.mem_bandwidth, overhead_s)


def step_time(model: ModelPreset | str, gpu: GPUPreset | str, num_prefill_tokens: int,
              num_decode_tokens: int, context_tokens: int, *, attention_pairs: int | None = None,
              overhead_s: float = STEP_OVERHEAD_S) -> float:
    """Seconds one engine step takes on ``gpu`` (0.0 for an empty step)."""
    return step_cost(model, gpu, num_prefill_tokens, num_decode_tokens, context_tokens,
                     attention_pairs=attention_pairs, overhead_s=overhead_s).time_s


def max_kv_tokens(model: ModelPreset | str, gpu: GPUPreset | str,
                  gpu_memory_utilization: float = 0.9) -> int:
    """How many tokens of KV cache fit beside the weights, as vLLM sizes its pool: a fraction of
    GPU memory minus the weights (activations ignored). Llama-2-7B on an A100-80GB at 0.9:
    (77.3 GB - 13.5 GB) / 512 KiB per token = ~122k tokens."""
    m, g = get_model_preset(model), get_gpu(gpu)
    if not 0 < gpu_memory_utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {gpu_memory_utilization}")
    free = g.mem_bytes * gpu_memory_utilization - m.weight_bytes
    if free <= 0:
        raise ValueError(f"{m.name} weights ({m.weight_bytes / 1e9:.1f} GB) do not fit on {g.name}")
    return int(free // m.kv_bytes_per_token)

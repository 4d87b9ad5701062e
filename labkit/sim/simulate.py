"""simulate(): "Llama-2-7B on an A100, 1,000 chat requests" in seconds, with the engine's code.

Builds an LLMEngine around a SimExecutor and a virtual clock, sizes the KV pool as vLLM would
(a fraction of GPU memory minus the weights, or ``kv_cache_bytes``), feeds it a workload from
``labkit.sim.workloads`` (arrivals at t=0 or Poisson at ``arrival_rate``), steps it to the end and
returns the trace, the serving metrics and the per-request timings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from labkit.config import EngineConfig
from labkit.engine.clock import VirtualClock
from labkit.engine.llm_engine import LLMEngine
from labkit.engine.metrics import compute_metrics
from labkit.engine.sampling_params import SamplingParams
from labkit.engine.trace import Trace
from labkit.errors import EngineConfigError
from labkit.sim.cost import max_kv_tokens
from labkit.sim.executor import SimExecutor
from labkit.sim.presets import get_gpu, get_model_preset
from labkit.sim.workloads import RequestSpec, Workload, get_workload
from labkit.utils import check_int


@dataclass
class SimResult:
    trace: Trace
    metrics: dict[str, Any]
    timings: list[dict[str, Any]]
    stats: dict[str, Any] = field(default_factory=dict)
    engine: LLMEngine | None = None


def simulate(model: str = "llama-2-7b", gpu: str = "a100-80gb",
             workload: str | Workload | list[RequestSpec] = "chat", num_requests: int = 200,
             arrival_rate: float | None = None, block_size: int = 16, max_num_seqs: int = 256,
             max_num_batched_tokens: int = 2048, policy: str = "fcfs",
             enable_prefix_caching: bool = True, batching: str = "continuous",
             kv_cache_bytes: int | None = None, seed: int = 0, progress: bool = False,
             record_trace: bool = True, **engine_kw: Any) -> SimResult:
    """Simulate serving ``workload`` (a name, a Workload, or a list of RequestSpec).

    Extra keyword arguments go to LLMEngine (e.g. ``enable_chunked_prefill``,
    ``preemption_mode``, ``num_cpu_blocks``, ``watermark_high``/``watermark_low``)."""
    check_int("block_size", block_size)  # before it divides the byte budget
    m, g = get_model_preset(model), get_gpu(gpu)
    if isinstance(workload, list):
        specs = workload
    else:
        specs = get_workload(workload).sample(num_requests, seed, arrival_rate)
    per_token = m.kv_bytes_per_token
    if kv_cache_bytes is None:
        kv_cache_bytes = max_kv_tokens(m, g) * per_token
    num_blocks = int(kv_cache_bytes // (block_size * per_token))
    if num_blocks < 1:
        raise EngineConfigError(f"kv_cache_bytes={kv_cache_bytes} holds no {block_size}-token "
                                f"block of {m.name} ({per_token} bytes per token)")
    max_len = max((s.prompt_len + s.output_len for s in specs), default=2) + 1
    clock = VirtualClock()
    vocab = getattr(m, "vocab_size", 32000)
    config = EngineConfig.from_kwargs(
        num_blocks=num_blocks, block_size=block_size, max_model_len=max_len, vocab_size=vocab,
        enable_prefix_caching=enable_prefix_caching, policy=policy, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, batching=batching, name=m.name,
        **engine_kw)
    engine = LLMEngine(config, SimExecutor(m, g, clock, vocab, block_size), clock=clock)
    engine.record_trace = record_trace
    engine.trace.meta.update({"gpu": g.name, "kv_cache_bytes": int(kv_cache_bytes)})
    _run(engine, specs, vocab, f"simulate {m.name} on {g.name}" if progress else None)
    timings = engine.request_timings()
    stats = engine.stats()
    stats["busy_s"] = engine.executor.busy_s
    stats["block_ops_s"] = engine.executor.block_ops_s
    return SimResult(engine.trace, compute_metrics(timings), timings, stats, engine)


def _run(engine: LLMEngine, specs: list[RequestSpec], vocab: int, progress: str | None) -> None:
    """Add every request (its arrival time on the virtual clock) and step to the end."""
    for i, s in enumerate(specs):
        params = SamplingParams(temperature=0.0, max_tokens=s.output_len, ignore_eos=True,
                                detokenize=False)
        engine.add_request(f"r{i}", s.prompt_token_ids(vocab), params, priority=s.priority,
                           arrival_time=s.arrival_time)
    bar = tqdm(total=len(specs), desc=progress, disable=progress is None)
    while engine.has_unfinished_requests():
        bar.update(sum(o.finished for o in engine.step()))
    bar.close()

"""The serving knee, measured beside the simulator's prediction (``labkit bench serve``).

The rate sweep measures where the server's latency turns up (the knee: past its capacity the
queue grows and TTFT with it). The prediction runs the same sweep through the simulator: the
engine's real scheduler and block manager on a virtual clock (``labkit.sim``), with the same
requests (prompt token ids, ``max_tokens``), the same arrival times (the client's
``arrival_gaps`` with the sweep's seed) and the same engine limits.

Why a fitted clock and not a roofline preset: ``labkit.sim``'s presets describe GPUs, where a
step's time follows FLOPs and bytes. The model measured here is labkit-tiny on a CPU, where a
step costs mostly fixed Python and per-op overhead. So the step time is a line fitted, in the same
run, to the real engine's own steps (``duration ~ a + b * batched tokens + c * sequences``, least
squares over the in-process ``LLM.generate`` trace) -- the simulator's method with a measured
cost model in place of the roofline one.

What it predicts is the *engine's* knee. The server adds HTTP, JSON and SSE work per token on the
same interpreter, so its measured capacity is lower by about ``http_over_in_process``; the
report gives both and their ratio rather than pretending they should be equal.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from labkit.bench.serve_client import arrival_gaps
from labkit.config import EngineConfig
from labkit.engine.clock import VirtualClock
from labkit.engine.llm_engine import LLMEngine
from labkit.engine.metrics import compute_metrics
from labkit.engine.sampling_params import SamplingParams
from labkit.sim.executor import SimExecutor


def fit_step_time(steps: list[dict[str, Any]]) -> dict[str, float]:
    """Least-squares ``duration = a + b * tokens + c * seqs`` over trace step records (those
    that ran something); coefficients clipped at 0 (a negative cost would be noise)."""
    rows = [(s["num_batched_tokens"], len(s["scheduled"]), s["duration"]) for s in steps
            if s["scheduled"] and s["duration"] > 0]
    if len(rows) < 3:
        raise ValueError(f"need at least 3 timed steps to fit a step time, got {len(rows)}")
    a = np.asarray(rows, dtype=np.float64)
    x = np.column_stack([np.ones(len(a)), a[:, 0], a[:, 1]])
    coef = np.clip(np.linalg.lstsq(x, a[:, 2], rcond=None)[0], 0.0, None)
    pred = x @ coef
    ss = float(((a[:, 2] - a[:, 2].mean()) ** 2).sum())
    r2 = 1.0 - float(((a[:, 2] - pred) ** 2).sum()) / ss if ss > 0 else 1.0
    return {"a_s": float(coef[0]), "per_token_s": float(coef[1]), "per_seq_s": float(coef[2]),
            "r2": r2, "num_steps": len(a)}


class FittedExecutor(SimExecutor):
    """The simulator's executor (placeholder tokens, no tensors) charging each step the fitted
    time instead of the roofline's."""

    name = "sim-fitted"

    def __init__(self, fit: dict[str, float], clock: VirtualClock, vocab_size: int,
                 block_size: int) -> None:
        super().__init__("llama-2-7b", "a100-80gb", clock, vocab_size, block_size)  # shapes
        self.fit = fit  # duration = a_s + per_token_s * tokens + per_seq_s * sequences

    def execute(self, out: Any) -> Any:
        clock = self.clock
        self.clock = VirtualClock()  # the parent emits the tokens; the fit charges the time
        try:
            results = super().execute(out)
        finally:
            self.clock = clock
        f = self.fit
        clock.advance(f["a_s"] + f["per_token_s"] * out.num_batched_tokens
                      + f["per_seq_s"] * len(out.scheduled))
        return results


def simulate_rate(fit: dict[str, float], prompts: list[list[int]], max_tokens: list[int],
                  rate: float, burstiness: float = 1.0, seed: int = 0, *, vocab_size: int,
                  max_num_seqs: int = 16, num_blocks: int = 512, block_size: int = 16,
                  max_model_len: int = 1024) -> dict[str, Any]:
    """One sweep point on the fitted clock; fields as the measured sweep's (vLLM names)."""
    clock = VirtualClock()
    config = EngineConfig.from_kwargs(num_blocks=num_blocks, block_size=block_size,
                                      max_model_len=max_model_len, vocab_size=vocab_size,
                                      max_num_seqs=max_num_seqs, name="fitted")
    eng = LLMEngine(config, FittedExecutor(fit, clock, vocab_size, block_size), clock=clock)
    eng.record_trace = False
    arrivals = np.cumsum(arrival_gaps(len(prompts), rate, burstiness, seed))
    for i, (ids, mt, t) in enumerate(zip(prompts, max_tokens, arrivals)):
        eng.add_request(f"r{i}", list(ids), SamplingParams(
            temperature=0.0, max_tokens=mt, ignore_eos=True, detokenize=False),
            arrival_time=float(t))
    while eng.has_unfinished_requests():
        eng.step()
    m = compute_metrics(eng.request_timings())
    ms = lambda v: None if v is None else v * 1000.0  # noqa: E731
    return {"request_rate": rate, "request_throughput": m["requests_per_s"],
            "output_throughput": m["tokens_per_s"], "median_ttft_ms": ms(m["ttft"]["p50"]),
            "p99_ttft_ms": ms(m["ttft"]["p99"]), "median_tpot_ms": ms(m["tpot"]["p50"])}


def knee_report(measured: list[dict[str, Any]], simulated: list[dict[str, Any]],
                fit: dict[str, float]) -> dict[str, Any]:
    """Capacity (the highest achieved requests/s over the sweep: where the curve flattens) of
    the server and of the simulated engine, and their ratio."""
    from labkit.bench.saturation import knee_check

    cap_m = max(r["request_throughput"] or 0.0 for r in measured)
    cap_s = max(r["request_throughput"] or 0.0 for r in simulated)
    return {"measured_capacity_req_s": cap_m, "simulated_capacity_req_s": cap_s,
            "measured_over_simulated": cap_m / cap_s if cap_s else None, "step_fit": fit,
            "verdict": knee_check(measured, cap_m)}

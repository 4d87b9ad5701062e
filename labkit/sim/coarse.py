"""Coarse tokens for fleet-scale simulation: one engine token stands for ``scale`` real tokens.

Why: the simulator runs the engine's real scheduler and block manager, whose Python cost is per
token per step (tens of microseconds). One H100 serving Llama-3-8B emits ~10k tokens/s, so a
simulated replica runs at about real time, and a fleet over a day would take days. With
``scale = k``, a request of P prompt and O output tokens enters the engine as ceil(P/k) and
ceil(O/k) tokens, the block size is ``16 / k`` (a block still covers 16 real tokens, so prefix
hits are the same blocks) and the step budget counts k real tokens per engine token. The
:class:`CoarseSimExecutor` charges each engine step as the real steps it stands for:

- a step with decodes stands for k real steps (each decoding sequence emits k real tokens); its
  prefill chunk is spread evenly over them, as chunked prefill would;
- a prefill-only step stands for ceil(real prefill tokens / real budget) real steps;
- each real step costs ``labkit.sim.cost.step_time`` with that step's token counts and the
  average KV context, and the causal attention pairs are exact.

What it costs in fidelity (``scale=1`` is exactly ``SimExecutor``; tests compare the two): a
request arriving mid-step is admitted at the coarse step's end, up to k - 1 real steps later than
a real engine would (~(k - 1) * 6 ms for Llama-3-8B on an H100); ``first_token_early`` takes back
all but one real step of that wait (an upper bound on the real wait). Its first token, too, is
dated where it would have come within the coarse step: chunked prefill runs the decodes plus
``budget - decodes`` prompt tokens per real step, so a prompt whose chunk ends after C prompt
tokens of this step samples at real step ceil(C / (budget - decodes)); ``first_token_early`` adds
how much earlier than the step's end that is, and the fleet subtracts the total from TTFT. Both
are first-order corrections (the request's later steps stay shifted): at k = 4 TTFT percentiles
stay within ~20 ms + 15% of k = 1. Per-token gaps (ITL) are averaged over k tokens. KV usage and
prefix hits are exact to the block.
"""

from __future__ import annotations

import math
from typing import Any

from labkit.config import EngineConfig
from labkit.engine.clock import VirtualClock
from labkit.engine.llm_engine import LLMEngine
from labkit.engine.sampling_params import SamplingParams
from labkit.errors import EngineConfigError
from labkit.sched.scheduler import SchedulerOutput
from labkit.sim.cost import attention_pairs, max_kv_tokens, step_time
from labkit.sim.executor import SimExecutor
from labkit.sim.presets import get_gpu, get_model_preset
from labkit.sim.workloads import RequestSpec


class CoarseSimExecutor(SimExecutor):

    def __init__(self, model: Any, gpu: Any, clock: VirtualClock, vocab_size: int,
                 block_size: int, scale: int, budget_tokens: int) -> None:
        super().__init__(model, gpu, clock, vocab_size, block_size)  # block_size: real tokens
        self.scale, self.budget_tokens = scale, budget_tokens
        self.first_token_early: dict[str, float] = {}  # seq_id -> seconds (module doc)
        self.real_step_s = 0.0  # duration of one real step in the last coarse step

    def execute(self, out: SchedulerOutput) -> Any:
        clock, busy = self.clock, self.busy_s
        self.clock = VirtualClock()  # the parent emits the placeholder tokens; we charge time
        try:
            results = super().execute(out)
        finally:
            self.clock, self.busy_s = clock, busy
        dt = self.step_seconds(out)
        self.busy_s += dt
        clock.advance(dt)
        return results

    def step_seconds(self, out: SchedulerOutput) -> float:
        """Time of the real steps one coarse step stands for (module doc); records in
        ``first_token_early`` how much earlier than the coarse step's end each prompt finishing
        here would have sampled its first token."""
        k = self.scale
        prefill = decode = 0
        ctx = pairs = 0.0  # summed over the real steps
        done: list[tuple[str, int]] = []  # (seq_id, prefill tokens up to and including it)
        for sc in out.scheduled:
            n, s = sc.num_new_tokens * k, sc.start_pos * k
            if sc.is_prefill:
                prefill += n
                pairs += attention_pairs(s, n)
                ctx += s  # per real step, scaled below
                if sc.samples:
                    done.append((sc.seq.seq_id, prefill))
            else:  # k real decode steps at positions s .. s+k-1
                decode += sc.num_new_tokens
        r = k if decode else max(1, math.ceil(prefill / self.budget_tokens))
        ctx = ctx * r + prefill * (r - 1) / 2  # chunks split over r steps read more context
        for sc in out.scheduled:
            if not sc.is_prefill:
                s = sc.start_pos * k
                ctx += k * s + k * (k - 1) / 2
                pairs += k * s + k * (k + 1) / 2
        if prefill + decode == 0:
            return 0.0
        per_step = step_time(self.model, self.gpu, prefill // r, decode, int(ctx / r),
                             attention_pairs=int(pairs / r))
        per_prefill_step = max(self.budget_tokens - decode, 1)  # decodes go first, as vLLM
        for seq_id, upto in done:
            j = min(r, max(1, math.ceil(upto / per_prefill_step)))
            early = self.first_token_early
            early[seq_id] = early.get(seq_id, 0.0) + (r - j) * per_step
        self.real_step_s = per_step
        return r * per_step


def coarse_engine(model: str, gpu: str, scale: int = 1, block_size: int = 16,
                  max_num_seqs: int = 256, max_num_batched_tokens: int = 2048,
                  max_model_len: int = 8192, kv_cache_bytes: int | None = None,
                  enable_prefix_caching: bool = True, start: float = 0.0,
                  **engine_kw: Any) -> LLMEngine:
    """An LLMEngine over a CoarseSimExecutor on its own virtual clock starting at ``start``.
    Sizes are in real tokens; the KV pool is sized as ``simulate`` sizes it (vLLM's 90%)."""
    if scale < 1 or block_size % scale:
        raise EngineConfigError(f"token scale must be >= 1 and divide block_size={block_size}, "
                                f"got {scale}")
    m, g = get_model_preset(model), get_gpu(gpu)
    if kv_cache_bytes is None:
        kv_cache_bytes = max_kv_tokens(m, g) * m.kv_bytes_per_token
    num_blocks = int(kv_cache_bytes // (block_size * m.kv_bytes_per_token))
    if num_blocks < 1:
        raise EngineConfigError(f"kv_cache_bytes={kv_cache_bytes} holds no {block_size}-token "
                                f"block of {m.name}")
    clock = VirtualClock(start)
    ex = CoarseSimExecutor(m, g, clock, m.vocab_size, block_size, scale, max_num_batched_tokens)
    config = EngineConfig.from_kwargs(
        num_blocks=num_blocks, block_size=block_size // scale,
        max_model_len=math.ceil(max_model_len / scale) + 1, vocab_size=m.vocab_size,
        enable_prefix_caching=enable_prefix_caching, max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens, name=m.name, **engine_kw)
    eng = LLMEngine(config, ex, clock=clock)
    eng.record_trace = False
    eng.token_scale = scale
    return eng


def add_coarse_request(engine: LLMEngine, request_id: str, spec: RequestSpec,
                       arrival_time: float, token_ids: list[int] | None = None) -> None:
    """Queue ``spec`` on a coarse engine; ``token_ids``: its real prompt, if already drawn."""
    k = getattr(engine, "token_scale", 1)
    ids = spec.prompt_token_ids(engine.vocab_size) if token_ids is None else token_ids
    params = SamplingParams(temperature=0.0, max_tokens=math.ceil(spec.output_len / k),
                            ignore_eos=True, detokenize=False)
    # every k-th real token: ceil(P / k) engine tokens, and with random ids two prompts share
    # them exactly where they share whole 16-token blocks
    req = engine.add_request(request_id, ids[::k], params, priority=spec.priority,
                             arrival_time=arrival_time)
    ex = engine.executor
    late = engine.clock.now() - arrival_time  # waited for the coarse step in flight
    if late > ex.real_step_s and hasattr(ex, "first_token_early"):
        # a real engine would have admitted it after at most the real step in flight
        ex.first_token_early[req.seqs[0].seq_id] = late - ex.real_step_s

"""The load generator's client: OpenAI-compatible requests on a schedule, timed from outside.

Works against any server speaking ``/v1/completions`` with SSE (labkit's, vLLM's, llama.cpp's).
The client is aiohttp, as in vLLM's benchmark: a load generator on the same machine takes CPU
from the server it measures, and aiohttp's C parser spends about a third of httpx's per
streamed chunk (measured here: 0.3-0.4 vs 0.9-1.0 CPU-seconds for 64 requests x 64 tokens).
Arrivals, as vLLM's ``benchmark_serving``:

- ``rate=inf``: everything at t=0 (throughput);
- Poisson at ``rate`` req/s: exponential gaps, mean 1/rate (``burstiness=1``);
- bursty: gamma gaps with shape ``burstiness`` < 1 and the same mean (clumps and lulls);
- ``max_concurrency``: at most that many requests in flight (a fixed-concurrency run with
  ``rate=inf``).

Per request, seen from the client: TTFT = first content chunk - send; ITL = every gap between
content chunks; TPOT = (E2E - TTFT) / (output tokens - 1); E2E = last byte - send. Output
tokens come from the final ``usage`` chunk (``stream_options.include_usage``) when the server
sends one, else from the chunk count. The summary uses vLLM's field names
(``request_throughput``, ``output_throughput``, ``mean_ttft_ms``, ``p99_ttft_ms``...).
"""

from __future__ import annotations

import asyncio
import gc
import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from labkit.utils import freeze_gc_heap


@dataclass
class BenchRequest:
    prompt: str | list[int]
    max_tokens: int
    api_key: str | None = None
    tag: str = ""  # e.g. the tenant, for per-group summaries


@dataclass
class RequestResult:
    tag: str = ""
    ok: bool = False
    status: int = 0
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""
    start: float = 0.0

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def arrival_gaps(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> np.ndarray:
    """Seconds between consecutive sends: gamma(shape=burstiness, mean=1/rate); rate inf = 0."""
    if not rate > 0:
        raise ValueError(f"request rate must be > 0 (inf = all at once), got {rate}")
    if not burstiness > 0:
        raise ValueError(f"burstiness must be > 0 (1 = Poisson), got {burstiness}")
    if np.isinf(rate):
        return np.zeros(n)
    rng = np.random.default_rng(seed)
    return rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)


async def send(session: aiohttp.ClientSession, url: str, model: str, req: BenchRequest,
               extra: dict[str, Any] | None = None) -> RequestResult:
    """One streaming completion, timed chunk by chunk."""
    body = {"model": model, "prompt": req.prompt, "max_tokens": req.max_tokens,
            "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True},
            **(extra or {})}
    headers = {"Authorization": f"Bearer {req.api_key}"} if req.api_key else {}
    res = RequestResult(tag=req.tag)
    t0 = res.start = time.perf_counter()
    last = t0
    chunks, parts = 0, []
    try:
        async with session.post(url + "/v1/completions", json=body, headers=headers) as r:
            res.status = r.status
            if r.status != 200:
                res.error = (await r.read()).decode(errors="replace")[:300]
                res.e2e = time.perf_counter() - t0
                return res
            async for line in r.content:  # one SSE line at a time
                if not line.startswith(b"data: "):
                    continue
                data = line[6:].strip()
                if data == b"[DONE]":
                    break
                d = json.loads(data)
                if "error" in d:
                    res.error = str(d["error"])
                    break
                if d.get("usage"):
                    res.output_tokens = d["usage"]["completion_tokens"]
                    res.prompt_tokens = d["usage"]["prompt_tokens"]
                text = "".join(c.get("text", "") for c in d.get("choices", []))
                if text:
                    now = time.perf_counter()
                    if res.ttft is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    chunks += 1
                    parts.append(text)
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.e2e = time.perf_counter() - t0
    res.text = "".join(parts)
    res.output_tokens = res.output_tokens or chunks
    res.ok = not res.error and res.status == 200
    return res


_runs = 0  # loads running now in this process (two tenants run two at once)


async def run_load(url: str, model: str, requests: list[BenchRequest], rate: float = np.inf,
                   burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
                   extra: dict[str, Any] | None = None, progress: Any = None,
                   timeout: float = 600.0) -> tuple[list[RequestResult], float]:
    """Send ``requests`` on the arrival schedule; returns (results in send order, duration)."""
    gaps = arrival_gaps(len(requests), rate, burstiness, seed)
    global _runs
    if _runs == 0:
        freeze_gc_heap()  # a full collection mid-run would stall every stream being timed
    _runs += 1
    try:
        return await _run(url, model, requests, gaps, max_concurrency, extra, progress, timeout)
    finally:
        _runs -= 1
        if _runs == 0:  # the last of concurrent loads: the caller's heap is its own again
            gc.unfreeze()


async def _run(url: str, model: str, requests: list[BenchRequest], gaps: np.ndarray,
               max_concurrency: int | None, extra: dict[str, Any] | None, progress: Any,
               timeout: float) -> tuple[list[RequestResult], float]:
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    conn = aiohttp.TCPConnector(limit=0)  # no client-side cap: the schedule decides
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(
            total=timeout)) as session:
        async def one(req: BenchRequest) -> RequestResult:
            if sem is None:
                r = await send(session, url, model, req, extra)
            else:
                async with sem:
                    r = await send(session, url, model, req, extra)
            if progress is not None:
                progress.update(1)
            return r

        t0 = time.perf_counter()
        tasks = []
        for req, gap in zip(requests, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(req)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


def _stats(prefix: str, values: list[float], percentiles: tuple[int, ...]) -> dict[str, float]:
    a = np.asarray(values, dtype=np.float64) * 1000.0
    if a.size == 0:
        return {f"mean_{prefix}_ms": None, f"median_{prefix}_ms": None,
                f"std_{prefix}_ms": None, **{f"p{p}_{prefix}_ms": None for p in percentiles}}
    return {f"mean_{prefix}_ms": float(a.mean()), f"median_{prefix}_ms": float(np.median(a)),
            f"std_{prefix}_ms": float(a.std()),
            **{f"p{p}_{prefix}_ms": float(np.percentile(a, p)) for p in percentiles}}


def summarize(results: list[RequestResult], duration: float,
              slo_ms: dict[str, float] | None = None,
              percentiles: tuple[int, ...] = (50, 90, 99)) -> dict[str, Any]:
    """vLLM ``benchmark_serving`` fields over the successful requests; goodput counts the
    requests that meet every SLO (``{"ttft": ms, "tpot": ms, "e2el": ms}``)."""
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    good = [r for r in ok if all(
        (v is not None and v * 1000 <= lim) for k, lim in (slo_ms or {}).items()
        for v in [{"ttft": r.ttft, "tpot": r.tpot or 0.0, "e2el": r.e2e}[k]])]
    return {
        "completed": len(ok), "failed": len(results) - len(ok), "duration": duration,
        "total_input_tokens": in_tokens, "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration else None,
        "request_goodput": len(good) / duration if duration and slo_ms else None,
        "output_throughput": out_tokens / duration if duration else None,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration else None,
        **_stats("ttft", [r.ttft for r in ok if r.ttft is not None], percentiles),
        **_stats("tpot", [r.tpot for r in ok if r.tpot is not None], percentiles),
        **_stats("itl", [g for r in ok for g in r.itl], percentiles),
        **_stats("e2el", [r.e2e for r in ok], percentiles),
        "status_counts": {str(s): sum(1 for r in results if r.status == s)
                          for s in sorted({r.status for r in results})},
    }


def make_requests(n: int, max_tokens: int, dataset: str = "code_prompts", api_key: str | None
                  = None, tag: str = "", offset: int = 0) -> list[BenchRequest]:
    """``n`` requests over a prompt set of ``datasets/workloads/`` (cycled from ``offset``)."""
    from labkit.sim.workloads import prompt_texts

    texts = prompt_texts(dataset)
    return [BenchRequest(texts[(offset + i) % len(texts)], max_tokens, api_key, tag)
            for i in range(n)]


def load(url: str, model: str, reqs: list[BenchRequest], bar: Any, **kw: Any) -> tuple:
    """``run_load`` to completion from synchronous code (``ignore_eos``: exact lengths)."""
    return asyncio.run(run_load(url, model, reqs, extra={"ignore_eos": True}, progress=bar,
                                **kw))


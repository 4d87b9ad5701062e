"""``labkit bench serve-soak``: a bounded soak of ``labkit serve`` with misbehaving clients.

A mix that a public endpoint sees, seeded: streaming and not, ``n`` of 1 or 2, stop strings,
about 20% of clients that disconnect (mid-stream, or before a non-streaming answer) and 10% that
send invalid requests. What must hold afterwards:

- no 5xx at all (every client mistake is a 4xx; a disconnect is not an error of the server);
- every completed greedy response equals in-process generation token for token;
- the engine holds nothing (``assert_no_leaks``) and the server's counters add up:
  accepted = finished + aborted + timed out;
- memory is flat: sampled every 5% of the requests, the engine's bookkeeping (requests it holds
  state for) and, with a server process, the resident memory of it and its engine process do not
  grow with the number of requests served. "Flat" is a trend, not a reading: the least-squares
  slope over the samples after the warm-up quarter, extrapolated to 1,000 requests
  (:func:`memory_trend`), must stay under a stated bound (:data:`FLAT_LIMITS`). A server that
  kept every finished request would grow by about 1,000 held requests per 1,000; one that keeps
  a bounded record, by about 0.

The test suite runs it at 200 requests on an in-process server; the command runs 1,000 against a
``labkit serve`` child process.
"""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from labkit.sim.workloads import prompt_texts

# growth per 1,000 requests (least-squares slope after warm-up) that still counts as flat:
# held requests fluctuate with the ~16 in flight, so their slope is noisy by tens, while keeping
# every request would give ~1,000; resident memory moves with allocator arenas by a few MiB.
FLAT_LIMITS = {"requests_held": 100.0, "rss_kb": 16384.0}

INVALID = [
    b"{oops", b'{"prompt": "x", "max_tokens": 0}', b'{"prompt": "x", "model": "nope"}',
    b'{"prompt": [], "max_tokens": 4}', b'{"prompt": "x", "temperature": "hot"}',
    b'{"prompt": "x", "n": -1}', b'{"prompt": "x", "stop": [3]}', b'["not", "an", "object"]',
    b'{"prompt": "x", "max_tokens": 100000}', b'{"prompt": "x", "logprobs": 99}',
]


@dataclass
class SoakCase:
    kind: str  # valid | disconnect | invalid
    body: dict[str, Any] | bytes
    stream: bool = False


@dataclass
class SoakReport:
    statuses: dict[int, int] = field(default_factory=dict)
    valid: list[tuple[dict, list[list[int]], list[str]]] = field(default_factory=list)
    disconnects: int = 0
    invalid_4xx: int = 0
    errors: list[str] = field(default_factory=list)
    samples: list[dict[str, float]] = field(default_factory=list)  # {"completed": n, ...}

    def count(self, status: int) -> None:
        self.statuses[status] = self.statuses.get(status, 0) + 1

    @property
    def num_5xx(self) -> int:
        return sum(v for k, v in self.statuses.items() if k >= 500)


def make_cases(n: int, model: str, seed: int = 0, max_tokens: int = 12) -> list[SoakCase]:
    rng = random.Random(seed)
    texts = prompt_texts("code_prompts")
    cases = []
    for _ in range(n):
        u = rng.random()
        body: dict[str, Any] = {"model": model, "prompt": rng.choice(texts)[:200],
                                "max_tokens": rng.randint(1, max_tokens), "temperature": 0,
                                "n": rng.choice((1, 1, 2)), "return_token_ids": True}
        if rng.random() < 0.3:
            body["stop"] = rng.choice(["\n\n", "return", ":"])
        if u < 0.1:
            cases.append(SoakCase("invalid", rng.choice(INVALID)))
        elif u < 0.3:
            cases.append(SoakCase("disconnect", {**body, "max_tokens": 200, "ignore_eos": True},
                                  rng.random() < 0.5))
        else:
            cases.append(SoakCase("valid", body, rng.random() < 0.5))
    return cases


async def _valid(c: httpx.AsyncClient, url: str, case: SoakCase, rep: SoakReport) -> None:
    body, k = case.body, case.body["n"]
    ids: list[list[int]] = [[] for _ in range(k)]
    texts = ["" for _ in range(k)]
    if not case.stream:
        r = await c.post(url, json=body)
        rep.count(r.status_code)
        if r.status_code != 200:
            rep.errors.append(r.text[:200])
            return
        for ch in r.json()["choices"]:
            ids[ch["index"]], texts[ch["index"]] = ch["token_ids"], ch["text"]
    else:
        async with c.stream("POST", url, json={**body, "stream": True}) as r:
            rep.count(r.status_code)
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    d = json.loads(line[6:])
                    if "error" in d:
                        rep.errors.append(str(d["error"]))
                        return
                    for ch in d["choices"]:
                        ids[ch["index"]] += ch["token_ids"]
                        texts[ch["index"]] += ch["text"]
    rep.valid.append((body, ids, texts))


async def _disconnect(c: httpx.AsyncClient, url: str, case: SoakCase, rep: SoakReport,
                      rng: random.Random) -> None:
    rep.disconnects += 1
    if case.stream:
        async with c.stream("POST", url, json={**case.body, "stream": True}) as r:
            rep.count(r.status_code)
            lines = r.aiter_lines()
            for _ in range(rng.randint(0, 3)):  # leave after a few chunks (or none)
                await lines.__anext__()
        return
    try:
        r = await c.post(url, json=case.body, timeout=rng.uniform(0.05, 0.5))
        rep.count(r.status_code)
    except httpx.TimeoutException:
        pass


async def run_soak(base_url: str, cases: list[SoakCase], concurrency: int = 16, seed: int = 0,
                   probe: Any = None, progress: Any = None) -> SoakReport:
    """Drive the cases with at most ``concurrency`` in flight; ``probe()`` (optional, returns
    ``{name: number}``, e.g. resident memory and held requests) is sampled every 5% of the
    completed requests, into ``report.samples``."""
    rep, rng = SoakReport(), random.Random(seed + 1)
    url = base_url + "/v1/completions"
    sem = asyncio.Semaphore(concurrency)
    step = max(1, len(cases) // 20)
    completed = [0]
    async with httpx.AsyncClient(timeout=120) as c:
        async def one(i: int, case: SoakCase) -> None:
            async with sem:
                if case.kind == "invalid":
                    r = await c.post(url, content=case.body,
                                     headers={"content-type": "application/json"})
                    rep.count(r.status_code)
                    rep.invalid_4xx += 400 <= r.status_code < 500
                elif case.kind == "disconnect":
                    await _disconnect(c, url, case, rep, rng)
                else:
                    await _valid(c, url, case, rep)
            if progress is not None:
                progress.update(1)
            completed[0] += 1
            if probe is not None and completed[0] % step == 0:
                rep.samples.append({"completed": completed[0], **await probe()})
        await asyncio.gather(*(one(i, k) for i, k in enumerate(cases)))
    return rep


def memory_trend(samples: list[dict[str, float]], warmup: float = 0.25) -> dict[str, dict]:
    """Per sampled quantity: the least-squares slope against requests completed, over the
    samples after the first ``warmup`` fraction, as growth per 1,000 requests; plus first, last
    and max of those samples and whether the growth is within :data:`FLAT_LIMITS`."""
    rows = samples[int(len(samples) * warmup):]
    out: dict[str, dict] = {}
    if len(rows) < 3:
        return out
    x = np.array([r["completed"] for r in rows], dtype=np.float64)
    for key in rows[0]:
        if key == "completed":
            continue
        y = np.array([r[key] for r in rows], dtype=np.float64)
        slope = float(np.polyfit(x, y, 1)[0]) if np.ptp(x) > 0 else 0.0
        growth = slope * 1000.0
        out[key] = {"growth_per_1000_requests": growth, "first": float(y[0]),
                    "last": float(y[-1]), "max": float(y.max())}
        if key in FLAT_LIMITS:
            out[key]["limit"] = FLAT_LIMITS[key]
            out[key]["flat"] = growth < FLAT_LIMITS[key]
    return out


def check_greedy(rep: SoakReport, llm: Any) -> int:
    """Compare every completed response with ``llm.generate`` (same prompt, n, stop,
    max_tokens); returns the number compared, raises AssertionError on the first mismatch."""
    from labkit.engine.sampling_params import SamplingParams

    if not rep.valid:
        return 0
    params = [SamplingParams(n=b["n"], temperature=0, max_tokens=b["max_tokens"],
                             stop=b.get("stop")) for b, _, _ in rep.valid]
    outs = llm.generate([b["prompt"] for b, _, _ in rep.valid], params)  # one batch
    for (body, ids, _), want in zip(rep.valid, outs):
        got = [o.token_ids for o in want.outputs]
        if got != ids:
            raise AssertionError(f"response differs from in-process generation for {body}: "
                                 f"{ids} != {got}")
    return len(rep.valid)


def rss_kb(pid: int | str = "self") -> int:
    """Resident memory of a process (Linux /proc), in KiB."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def tree_rss_kb(pid: int) -> int:
    """Resident memory of a process and all its descendants, in KiB: ``labkit serve`` runs
    its engine in a child process, where the KV cache and the model live."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            total += rss_kb(p)
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue  # it exited between the listing and the read
    return total


def main(argv: list[str] | None = None) -> int:
    from tqdm.auto import tqdm

    from labkit.bench.common import bench_parser, write_json
    from labkit.engine.llm import LLM
    from labkit.serve.process import ServerProcess

    p = bench_parser("serve-soak", __doc__.splitlines()[0])
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--model", default="labkit-tiny")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    n = args.num_requests or (200 if args.quick else 1000)
    cases = make_cases(n, args.model, args.seed)
    bar = tqdm(total=n, desc="soak", unit="req")
    with ServerProcess(args.model, ["--num-blocks", "512", "--dtype", "float32"]) as srv:
        async def probe() -> dict[str, float]:
            async with httpx.AsyncClient() as c:
                text = (await c.get(srv.url + "/metrics")).text
            return {"rss_kb": tree_rss_kb(srv.proc.pid),
                    "requests_held": _metric(text, "labkit:num_requests_held")}

        rep = asyncio.run(run_soak(srv.url, cases, probe=probe, progress=bar))
        metrics = httpx.get(srv.url + "/metrics").text
    bar.close()
    llm = LLM(args.model, dtype="float32", num_blocks=512)
    compared = check_greedy(rep, llm)
    accepted = _metric(metrics, "labkit:request_accepted_total")
    # a client that left while its body was still being read was never accepted: its abort
    # (reason disconnect_reading_body) is not one of the accepted requests' ends
    done = (_metric(metrics, "labkit:request_aborted_total")
            - _metric(metrics, "labkit:request_aborted_total",
                      reason="disconnect_reading_body")
            + _metric(metrics, "labkit:e2e_request_latency_seconds_count"))
    trend = memory_trend(rep.samples)
    flat = all(t.get("flat", True) for t in trend.values()) and bool(trend)
    payload = {"num_requests": n, "statuses": rep.statuses, "num_5xx": rep.num_5xx,
               "disconnects": rep.disconnects, "invalid_4xx": rep.invalid_4xx,
               "greedy_compared": compared, "accepted": accepted,
               "finished_plus_aborted_plus_timed_out": done,
               "requests_held_at_end": _metric(metrics, "labkit:num_requests_held"),
               "memory_trend": trend, "memory_flat": flat, "samples": rep.samples,
               "errors": rep.errors[:10]}
    print(json.dumps({k: v for k, v in payload.items() if k != "samples"}, indent=1))
    write_json(args.json, payload)
    ok = rep.num_5xx == 0 and accepted == done and not rep.errors and flat
    return 0 if ok else 1


def _metric(text: str, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))

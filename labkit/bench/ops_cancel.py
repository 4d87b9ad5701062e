"""``labkit bench ops cancel``: how fast each cancel path frees KV; SSE tokens per event.

Against a real ``labkit serve`` (labkit-tiny, its engine in its own process, on 127.0.0.1):

- **cancel paths**: a long greedy generation (``ignore_eos``) is cancelled once it decodes, by
  (a) closing the HTTP connection (``disconnect``: the server's watcher sees ASGI's
  ``http.disconnect``), (b) ``POST /v1/requests/{id}/cancel`` from a second connection
  (``cancel-route``), (c) ``{"type": "cancel"}`` on the WebSocket route (``ws-cancel``), (d)
  closing the WebSocket (``ws-close``). Measured from the client: the time from the cancel to
  the server's ``labkit:kv_cache_usage_perc`` gauge reading 0 (polled on ``/metrics`` as fast as
  it answers; the engine core sends its stats with the abort, so the gauge is the engine's
  block count right after the abort was applied). The claim to check is "within one engine
  step": each trial also records the decode step before the cancel (the median gap between its
  events), and ``poll_ms`` bounds the resolution. Median / max over the trials, per path;
  ``ended_cleanly``: the cancelled stream (route, WebSocket message) ended with
  ``finish_reason: "abort"`` and its end marker.
- **tokens per event** (``--stream-interval N`` = 1, 4, 16; a server each): ``concurrency``
  greedy streams at once, each ``max_tokens`` long. Per N: bytes received per output token and
  events per token, the client-side gap between events (ITL p50 / p99), time to first token
  and the total time for the batch; ``same_text``: every N gave the text of N = 1.

Wall-clock numbers depend on the machine (the load average at the start is in
``environment``); the token and byte counts do not.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from typing import Any

import aiohttp
import numpy as np
from tqdm.auto import tqdm

from labkit.bench.common import bench_parser, environment, print_table, write_results
from labkit.serve.process import ServerProcess

QUICK = {"trials": 3, "warm_tokens": 12, "cancel_max_tokens": 900, "intervals": [1, 4, 16],
         "concurrency": 4, "max_tokens": 96, "prompt": "def fib(n):", "engine_threads": 1}
FULL = {**QUICK, "trials": 10, "concurrency": 16, "max_tokens": 256}
PATHS = ("disconnect", "cancel-route", "ws-cancel", "ws-close")
MODEL = "labkit-tiny"
_USAGE = re.compile(rb"^labkit:kv_cache_usage_perc\{[^}]*\} (\S+)$", re.M)


async def kv_usage(session: aiohttp.ClientSession, url: str) -> float:
    """The server's KV-cache usage gauge (used blocks / all blocks) from ``/metrics``."""
    async with session.get(url + "/metrics") as r:
        m = _USAGE.search(await r.read())
    if m is None:
        raise RuntimeError("labkit:kv_cache_usage_perc is missing from /metrics")
    return float(m.group(1))


async def wait_freed(session: aiohttp.ClientSession, url: str, t0: float,
                     timeout: float = 30.0) -> tuple[float | None, float]:
    """(seconds from ``t0`` until the gauge reads 0, or None; mean seconds per poll)."""
    polls = 0
    while time.perf_counter() - t0 < timeout:
        polls += 1
        if await kv_usage(session, url) == 0:
            dt = time.perf_counter() - t0
            return dt, dt / polls
    return None, (time.perf_counter() - t0) / polls


def _body(cfg: dict[str, Any], max_tokens: int, stream: bool = True) -> dict[str, Any]:
    return {"model": MODEL, "prompt": cfg["prompt"], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream}


async def _http_trial(session: aiohttp.ClientSession, url: str, cfg: dict[str, Any],
                      path: str) -> dict[str, Any]:
    resp = await session.post(url + "/v1/completions", json=_body(cfg, cfg["cancel_max_tokens"]))
    times, cid = [], None
    async for line in resp.content:
        if line.startswith(b"data: "):
            cid = cid or json.loads(line[6:])["id"]
            times.append(time.perf_counter())
            if len(times) >= cfg["warm_tokens"]:
                break
    before = await kv_usage(session, url)
    t0 = time.perf_counter()
    if path == "disconnect":
        resp.close()
        ended = None
    else:
        async with session.post(f"{url}/v1/requests/{cid}/cancel") as r:
            if r.status != 200:
                raise RuntimeError(f"cancel answered {r.status}: {await r.text()}")
    freed, poll = await wait_freed(session, url, t0)
    if path != "disconnect":
        events = [ln[6:].strip() for ln in (await resp.read()).splitlines()
                  if ln.startswith(b"data: ")]
        ended = events[-1] == b"[DONE]" and \
            json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
        resp.release()
    return _trial_row(path, times, before, freed, poll, ended)


async def _ws_trial(session: aiohttp.ClientSession, url: str, cfg: dict[str, Any],
                    path: str) -> dict[str, Any]:
    ws = await session.ws_connect(url.replace("http://", "ws://") + "/v1/completions/ws")
    await ws.send_json(_body(cfg, cfg["cancel_max_tokens"], stream=False))
    times = []
    while len(times) < cfg["warm_tokens"]:
        await ws.receive_json()
        times.append(time.perf_counter())
    before = await kv_usage(session, url)
    t0 = time.perf_counter()
    if path == "ws-cancel":
        await ws.send_json({"type": "cancel"})
    else:
        await ws.close()
    freed, poll = await wait_freed(session, url, t0)
    ended = None
    if path == "ws-cancel":
        msgs = [m.json() async for m in ws if m.type == aiohttp.WSMsgType.TEXT]
        ended = msgs[-1] == {"type": "done"} and \
            msgs[-2]["choices"][0]["finish_reason"] == "abort" and ws.close_code == 1000
        await ws.close()
    return _trial_row(path, times, before, freed, poll, ended)


def _trial_row(path: str, times: list[float], before: float, freed: float | None,
               poll: float, ended: bool | None) -> dict[str, Any]:
    step = float(np.median(np.diff(times))) if len(times) > 1 else None
    return {"path": path, "kv_usage_before": before,
            "freed_ms": None if freed is None else 1e3 * freed,
            "step_ms": None if step is None else 1e3 * step, "poll_ms": 1e3 * poll,
            "ended_cleanly": ended}


async def cancel_trials(url: str, cfg: dict[str, Any], bar: Any) -> list[dict[str, Any]]:
    """Every path ``trials`` times, interleaved (a drift in the machine's load hits all)."""
    rows = []
    async with aiohttp.ClientSession() as session:
        for _ in range(cfg["trials"]):
            for path in PATHS:
                trial = _http_trial if path in ("disconnect", "cancel-route") else _ws_trial
                rows.append(await trial(session, url, cfg, path))
                bar.update(1)
    return rows


def summarize_paths(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    out = {}
    for path in PATHS:
        mine = [r for r in rows if r["path"] == path]
        freed = [r["freed_ms"] for r in mine if r["freed_ms"] is not None]
        out[path] = {"trials": len(mine), "freed": len(freed),
                     "freed_ms_median": float(np.median(freed)) if freed else None,
                     "freed_ms_max": max(freed) if freed else None,
                     "step_ms_median": float(np.median([r["step_ms"] for r in mine])),
                     "poll_ms_median": float(np.median([r["poll_ms"] for r in mine])),
                     "ended_cleanly": None if mine[0]["ended_cleanly"] is None else
                     all(r["ended_cleanly"] for r in mine)}
    return out


async def _one_stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any]
                      ) -> dict[str, Any]:
    t0 = time.perf_counter()
    nbytes, times, text = 0, [], []
    async with session.post(url + "/v1/completions", json=body) as r:
        async for line in r.content:
            nbytes += len(line)
            if line.startswith(b"data: ") and not line.startswith(b"data: [DONE]"):
                times.append(time.perf_counter())
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return {"bytes": nbytes, "times": times, "text": "".join(text), "t0": t0}


async def interval_run(url: str, n: int, cfg: dict[str, Any]) -> tuple[dict[str, Any], list]:
    """``concurrency`` streams at once through a server with ``--stream-interval n``."""
    body = _body(cfg, cfg["max_tokens"])
    async with aiohttp.ClientSession() as session:
        await _one_stream(session, url, body)  # warm-up (first-request costs)
        t0 = time.perf_counter()
        res = await asyncio.gather(*(_one_stream(session, url, body)
                                     for _ in range(cfg["concurrency"])))
        total = time.perf_counter() - t0
    tokens = cfg["max_tokens"] * cfg["concurrency"]
    gaps = np.concatenate([np.diff(r["times"]) for r in res])
    events = sum(len(r["times"]) for r in res)
    return {"stream_interval": n, "streams": cfg["concurrency"], "output_tokens": tokens,
            "bytes_per_token": sum(r["bytes"] for r in res) / tokens,
            "events_per_token": events / tokens,
            "itl_p50_ms": 1e3 * float(np.percentile(gaps, 50)),
            "itl_p99_ms": 1e3 * float(np.percentile(gaps, 99)),
            "ttft_median_ms": 1e3 * float(np.median([r["times"][0] - r["t0"] for r in res])),
            "total_s": total}, [r["text"] for r in res]


def _server(n: int, cfg: dict[str, Any]) -> ServerProcess:
    return ServerProcess(MODEL, ["--stream-interval", str(n), "--engine-threads",
                                 str(cfg["engine_threads"])])


def run(quick: bool = True, sizes: dict[str, Any] | None = None) -> dict[str, Any]:
    cfg = {**(QUICK if quick else FULL), **(sizes or {})}
    rows, texts = [], {}
    bar = tqdm(total=cfg["trials"] * len(PATHS) + len(cfg["intervals"]), desc="ops cancel")
    servers = {n: _server(n, cfg).launch() for n in cfg["intervals"]}  # start side by side
    try:
        for srv in servers.values():
            srv.wait_ready()
        trials = asyncio.run(cancel_trials(servers[cfg["intervals"][0]].url, cfg, bar))
        for n, srv in servers.items():  # one at a time: the others sit idle meanwhile
            row, texts[n] = asyncio.run(interval_run(srv.url, n, cfg))
            rows.append(row)
            bar.update(1)
    finally:
        for srv in servers.values():
            srv.stop()
        bar.close()
    first = cfg["intervals"][0]
    return {"benchmark": "ops cancel", "quick": quick, "config": cfg, "model": MODEL,
            "kv_gauge": "labkit:kv_cache_usage_perc (GET /metrics)",
            "cancel_trials": trials, "cancel_paths": summarize_paths(trials),
            "stream_intervals": rows,
            "same_text": all(texts[n] == texts[first] for n in texts),
            "environment": environment()}


def write_chart(payload: dict[str, Any], path: Any) -> None:
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=(
        "cancel -> KV blocks freed (ms), per trial", "tokens per SSE event"))
    for p in PATHS:
        ms = [r["freed_ms"] for r in payload["cancel_trials"] if r["path"] == p]
        fig.add_box(y=ms, name=p, boxpoints="all", row=1, col=1)
    steps = [r["step_ms"] for r in payload["cancel_trials"]]
    fig.add_hline(y=float(np.median(steps)), line_dash="dot", row=1, col=1,
                  annotation_text="median decode step")
    xs = [r["stream_interval"] for r in payload["stream_intervals"]]
    for key in ("bytes_per_token", "itl_p50_ms", "itl_p99_ms"):
        fig.add_scatter(x=xs, y=[r[key] for r in payload["stream_intervals"]], name=key,
                        mode="lines+markers", row=1, col=2)
    fig.update_xaxes(type="log", title_text="--stream-interval N", row=1, col=2)
    fig.update_layout(title=f"Cancel paths and tokens per event ({payload['model']}, labkit "
                      "serve with its engine process)")
    fig.write_html(str(path), include_plotlyjs="directory")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("ops cancel", __doc__.splitlines()[0])
    args = p.parse_args(argv)
    payload = run(quick=args.quick)
    print_table([{"path": k, **v} for k, v in payload["cancel_paths"].items()])
    print_table(payload["stream_intervals"])
    print(f"same greedy text for every interval: {payload['same_text']}")
    write_results(args.json, payload, write_chart)
    return 0

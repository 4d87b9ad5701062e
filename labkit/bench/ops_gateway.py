"""``labkit bench ops gateway``: tiers, rate limits and fallback through a model gateway, live.

Two real ``labkit serve`` replicas of labkit-tiny: a premium pool (float32) and a standard pool
(INT8 weights, ``--quantization int8``), behind :mod:`labkit.router.gateway` with two keys, a
premium one (fallback: standard) and a standard one (a low rate limit). Three phases, the same
requests in each (greedy, so every answer can be checked against its pool's own model):

1. both pools up: each key is served by its own tier; the standard key's burst past its rate
   is refused with 429s;
2. the premium replica is killed: the gateway's health probes open its breaker, and premium
   requests fall back to the standard pool (counted in ``labkit_gateway_fallbacks_total``);
3. the standard replica is killed too: every request gets a 503 ``no_replica``, at once.

Reported per phase and key: answers by tier, 429s, 503s, other failures, latency p50; and
``premium_served_in_outage`` (the share of premium requests answered while its pool was down).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import numpy as np
from tqdm.auto import tqdm

from labkit.bench.common import bench_parser, environment, print_table, write_results

QUICK = {"requests": 8, "max_tokens": 8, "standard_rps": 2.0, "standard_burst": 2,
         "probe_interval_s": 0.2}
FULL = {**QUICK, "requests": 24, "max_tokens": 16}
MODEL = "labkit-tiny"
KEYS = {"sk-premium": "premium", "sk-standard": "standard"}


def gateway_config(urls: dict[str, str], cfg: dict[str, Any]) -> dict[str, Any]:
    return {"keys": KEYS,
            "tiers": {"premium": {"rps": 1000, "burst": 1000, "fallback": ["standard"]},
                      "standard": {"rps": cfg["standard_rps"], "burst": cfg["standard_burst"],
                                   "fallback": []}},
            "pools": {MODEL: {"premium": [urls["premium"]], "standard": [urls["standard"]]}}}


async def _one(client: httpx.AsyncClient, url: str, key: str, i: int,
               max_tokens: int) -> dict[str, Any]:
    t = time.perf_counter()
    r = await client.post(f"{url}/v1/completions", headers={"authorization": f"Bearer {key}"},
                          json={"model": MODEL, "prompt": f"def f{i}(x):", "temperature": 0,
                                "max_tokens": max_tokens, "ignore_eos": True})
    body = r.json()
    replica = r.headers.get("x-labkit-replica", "")  # MODEL/TIER-i: the pool that answered
    return {"key": KEYS[key], "status": r.status_code, "latency_s": time.perf_counter() - t,
            "i": i, "pool": replica.rsplit("/", 1)[-1].rsplit("-", 1)[0] if replica else None,
            "text": body["choices"][0]["text"] if r.status_code == 200 else None,
            "error": body.get("error", {}).get("code") if r.status_code != 200 else None}


async def _phase(url: str, cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """Each key sends ``requests`` at once (the standard key's burst meets its rate limit)."""
    async with httpx.AsyncClient(timeout=120) as client:
        jobs = [_one(client, url, key, i, cfg["max_tokens"]) for key in KEYS
                for i in range(cfg["requests"])]
        return await asyncio.gather(*jobs)


def _summary(phase: str, results: list[dict], texts: dict[str, dict[int, str]]) -> list[dict]:
    rows = []
    for tier in ("premium", "standard"):
        rs = [r for r in results if r["key"] == tier]
        ok = [r for r in rs if r["status"] == 200]
        rows.append({"phase": phase, "key": tier, "sent": len(rs), "ok": len(ok),
                     "answered_by_premium": sum(r["pool"] == "premium" for r in ok),
                     "answered_by_standard": sum(r["pool"] == "standard" for r in ok),
                     # the greedy answer is the one that pool's own model gives
                     "answers_match_pool": all(r["text"] == texts[r["pool"]][r["i"]]
                                               for r in ok),
                     "rate_limited_429": sum(r["status"] == 429 for r in rs),
                     "unavailable_503": sum(r["status"] == 503 for r in rs),
                     "other_failures": sum(r["status"] not in (200, 429, 503) for r in rs),
                     "latency_p50_ms": 1e3 * float(np.median([r["latency_s"] for r in rs]))})
    return rows


def _wait_breaker(url: str, tier: str, timeout: float = 20.0) -> str:
    """Until the gateway's probes have seen the killed replica (its breaker not closed)."""
    deadline = time.monotonic() + timeout
    state = "?"
    while time.monotonic() < deadline:
        reps = httpx.get(f"{url}/admin/replicas", timeout=5).json()
        state = next(r["breaker"] for r in reps if r["name"].endswith(f"/{tier}-0"))
        if state != "closed":
            return state
        time.sleep(0.1)
    raise TimeoutError(f"the gateway still routes to the killed {tier} replica ({state})")


def _reference_texts(cfg: dict[str, Any]) -> dict[str, dict[int, str]]:
    """What each pool's model answers to each prompt (greedy), in this process."""
    from labkit import LLM, SamplingParams
    from labkit.serve.engine_flags import load_for_serving

    sp = SamplingParams(temperature=0, max_tokens=cfg["max_tokens"], ignore_eos=True)
    prompts = [f"def f{i}(x):" for i in range(cfg["requests"])]
    out = {}
    for tier, quant in (("premium", None), ("standard", "int8")):
        llm = LLM(load_for_serving(MODEL, quant, "float32", "cpu"))  # what the server loads
        out[tier] = {i: o.outputs[0].text for i, o in enumerate(llm.generate(prompts, sp))}
    return out


def run(quick: bool = True, sizes: dict[str, Any] | None = None) -> dict[str, Any]:
    from labkit.router.faults import serve_in_thread
    from labkit.router.gateway import GatewayConfig, create_gateway_app
    from labkit.serve.process import ServerProcess

    cfg = {**(QUICK if quick else FULL), **(sizes or {})}
    texts = _reference_texts(cfg)
    base = ["--dtype", "float32", "--num-blocks", "256"]
    prem = ServerProcess(MODEL, base, name="premium")
    std = ServerProcess(MODEL, [*base, "--quantization", "int8"], name="standard")
    rows: list[dict] = []
    with prem, std, tqdm(total=3, desc="gateway phases") as bar:
        gw_cfg = GatewayConfig.from_dict(gateway_config({"premium": prem.url,
                                                         "standard": std.url}, cfg))
        app = create_gateway_app(gw_cfg, probe_interval_s=cfg["probe_interval_s"])
        with serve_in_thread(app) as url:
            for phase, kill, tier in (("both up", None, ""), ("premium down", prem, "premium"),
                                      ("all down", std, "standard")):
                if kill is not None:
                    kill.kill()  # a crash, as the gateway sees it
                    _wait_breaker(url, tier)
                rows += _summary(phase, asyncio.run(_phase(url, cfg)), texts)
                bar.update()
            metrics = httpx.get(f"{url}/metrics", timeout=5).text
    down = next(r for r in rows if r["phase"] == "premium down" and r["key"] == "premium")
    return {"benchmark": "ops gateway", "quick": quick, "config": cfg, "rows": rows,
            "premium_served_in_outage": down["ok"] / down["sent"],
            "answers_match_pool": all(r["answers_match_pool"] for r in rows),
            "fallbacks_counted": _counter(metrics, "labkit_gateway_fallbacks_total"),
            "environment": environment()}


def _counter(text: str, name: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == name)


def write_chart(payload: dict[str, Any], path: Any) -> None:
    import plotly.graph_objects as go

    rows = payload["rows"]
    x = [f"{r['phase']}<br>{r['key']} key" for r in rows]
    fig = go.Figure()
    for key, name in (("answered_by_premium", "premium pool"),
                      ("answered_by_standard", "standard pool"),
                      ("rate_limited_429", "429"), ("unavailable_503", "503")):
        fig.add_bar(x=x, y=[r[key] for r in rows], name=name)
    fig.update_layout(barmode="stack", yaxis_title="requests",
                      title="A model gateway: tiers, rate limits, fallback, 503")
    fig.write_html(str(path), include_plotlyjs="directory")


def main(argv: list[str] | None = None) -> int:
    args = bench_parser("ops gateway", __doc__.splitlines()[0]).parse_args(argv)
    payload = run(quick=args.quick)
    print_table(payload["rows"])
    print(f"premium requests answered while the premium pool was down: "
          f"{payload['premium_served_in_outage']:.0%}; fallbacks counted: "
          f"{payload['fallbacks_counted']:g}")
    write_results(args.json, payload, write_chart)
    return 0

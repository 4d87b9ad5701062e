"""The noisy neighbour of ``labkit bench serve`` (its step 5): a light tenant's p99 TTFT alone
and beside a tenant sending ten times its load, on a ``--policy fcfs`` and a ``--policy fair``
server, with the rates calibrated from the server's own capacity and the run checked for
saturation (:mod:`labkit.bench.saturation`) before its ratio is reported."""

from __future__ import annotations

import asyncio
from typing import Any

from labkit.bench.serve_client import load as _load
from labkit.bench.serve_client import make_requests, run_load, summarize


async def _two_tenants(url: str, light: list, heavy: list, rate: float, k: float,
                       bar: Any) -> tuple:
    """Both tenants' Poisson arrivals at once: light at ``rate``, heavy at ``k * rate``."""
    return await asyncio.gather(
        run_load(url, "labkit-tiny", light, rate, seed=1, progress=bar,
                 extra={"ignore_eos": True}),
        run_load(url, "labkit-tiny", heavy, rate * k, seed=2, progress=bar,
                 extra={"ignore_eos": True}))


def policy_args(policy: str, cfg: dict[str, Any]) -> list[str]:
    """The server flags of each way of sharing: ``fcfs``, ``fair`` (weighted fair queueing), or
    ``quota`` (fcfs with a per-tenant cap of half the batch: labkit.sched.quota)."""
    if policy == "quota":
        cap = max(1, cfg["fair_max_num_seqs"] // 2)
        return ["--policy", "fcfs", "--tenant-max-running", str(cap)]
    return ["--policy", policy]


def fairness(model_path: str, cfg: dict[str, Any], bar: Any,
             engine_args: tuple[str, ...] = (),
             policies: tuple[str, ...] = ("fcfs", "fair")) -> dict[str, Any]:
    """Light tenant p99 TTFT alone and beside a 10x heavy tenant, under each of ``policies``
    (the first calibrates the rate; :func:`policy_args` says what each is).

    The rates are calibrated, not fixed: a fixed heavy rate overloads a slow machine and
    idles a fast one (then fcfs shows no starvation, as nothing queues). So the fcfs server
    first measures its own capacity for these requests (a burst of ``8 * max_num_seqs``),
    the heavy tenant then offers ``overload`` x that capacity (Poisson), the light tenant a
    tenth of the heavy rate, for as long as ``light_n`` light requests take. The heavy backlog
    grows for the whole run on any machine; fcfs queues the light tenant behind it, fair
    should not."""
    from labkit.serve.process import ServerProcess

    n, k, mt = cfg["light_n"], cfg["heavy_mult"], cfg["fair_max_tokens"]
    light = make_requests(n, mt, api_key="k-light", tag="light")
    heavy = make_requests(n * k, mt, api_key="k-heavy", tag="heavy", offset=7)
    probe = make_requests(8 * cfg["fair_max_num_seqs"], mt, api_key="k-heavy", offset=7)
    out: dict[str, Any] = {}
    rate = 0.0
    for policy in policies:
        args = [*policy_args(policy, cfg), "--max-num-seqs", str(cfg["fair_max_num_seqs"]),
                "--num-blocks", "512", "--dtype", "float32", "--api-key", "k-light:light",
                "--api-key", "k-heavy:heavy", *engine_args]
        with ServerProcess(model_path, args) as srv:
            _load(srv.url, "labkit-tiny", [light[0], heavy[0]], None)  # warm-up, both tenants
            if not rate:  # requests/s this server finishes when it is never idle
                res, dur = _load(srv.url, "labkit-tiny", probe, bar)
                out["capacity_req_s"] = sum(r.ok for r in res) / dur
                rate = out["capacity_req_s"] * cfg["overload"] / k  # the light tenant's

            # mixed first: a solo run before it would leave the light tenant's counter ahead of
            # the heavy one's, a head start for the heavy tenant that is not the steady state
            mixed, d_mixed, hv, d_hv, check, rate = _saturating_mix(srv.url, light, heavy,
                                                                    rate, cfg, bar, out,
                                                                    policy == policies[0])
            solo, d_solo = _load(srv.url, "labkit-tiny", light, bar, rate=rate, seed=1)
        out[policy] = _policy_row(summarize(solo, d_solo), summarize(mixed, d_mixed),
                                  summarize(hv, d_hv), check)
        out[f"{policy}_light_p99_ttft_ratio"] = (out[policy]["light_mixed_p99_ttft_ms"] /
                                                 out[policy]["light_solo_p99_ttft_ms"])
    out["light_rate_req_s"], out["heavy_rate_req_s"] = rate, rate * k
    short = [f"{p}: {out[p]['saturation']['verdict'][len('inconclusive: '):]}"
             for p in policies if out[p]["saturation"]["verdict"] != "conclusive"]
    out["verdict"] = "conclusive" if not short else "inconclusive: " + "; ".join(short)
    return out


def _policy_row(s_solo: dict[str, Any], s_mixed: dict[str, Any], s_heavy: dict[str, Any],
                check: dict[str, Any]) -> dict[str, Any]:
    """One policy's result: the light tenant alone and mixed, what the heavy tenant got, and
    the saturation check that says whether the comparison tested anything."""
    return {"light_solo_p99_ttft_ms": s_solo["p99_ttft_ms"],
            "light_mixed_p99_ttft_ms": s_mixed["p99_ttft_ms"],
            "light_solo_p50_ttft_ms": s_solo["p50_ttft_ms"],
            "light_mixed_p50_ttft_ms": s_mixed["p50_ttft_ms"],
            "heavy_p99_ttft_ms": s_heavy["p99_ttft_ms"],
            "heavy_output_throughput": s_heavy["output_throughput"],
            "heavy_request_throughput": s_heavy["request_throughput"],
            "failed": s_solo["failed"] + s_mixed["failed"] + s_heavy["failed"],
            "saturation": check}


def _saturating_mix(url: str, light: list, heavy: list, rate: float, cfg: dict[str, Any],
                    bar: Any, out: dict[str, Any], may_raise: bool) -> tuple:
    """Both tenants at once, checked: did the heavy tenant's queue grow
    (:func:`labkit.bench.saturation.queue_check`)? A capacity probe can under-read (a short
    burst is mostly ramp and tail), so on the first server (``may_raise``) a run that did not
    saturate is repeated at twice the rate, up to twice; every short run is kept in
    ``out["recalibrations"]``. The second server gets the same rate, unchanged."""
    from labkit.bench.saturation import queue_check

    k = cfg["heavy_mult"]
    for attempt in range(3 if may_raise else 1):
        (mixed, d_mixed), (hv, d_hv) = asyncio.run(_two_tenants(url, light, heavy, rate, k,
                                                                bar))
        check = queue_check(mixed + hv, hv, cfg["fair_max_num_seqs"], rate * k)
        if check["verdict"] == "conclusive" or attempt == 2 or not may_raise:
            break
        out.setdefault("recalibrations", []).append({"light_rate_req_s": rate, **check})
        rate *= 2
    return mixed, d_mixed, hv, d_hv, check, rate

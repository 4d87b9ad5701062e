"""``labkit bench ops isolation``: a hard partition against sharing, for a light and a heavy tenant.

Live, on this CPU: two ``labkit serve`` processes, one per tenant, each with a fixed KV pool.
*Partitioned* pins them to disjoint cores (``taskset``; each one thread): the CPU analogue of
MIG, where nothing the heavy tenant does takes the light tenant's core, and nothing the light
tenant leaves idle helps the heavy one. *Shared* runs the same two processes on every core (the
OS time-slices them, as a GPU time-slices two processes). The light tenant sends Poisson
requests at a tenth of the heavy one's rate, the heavy one at ``heavy_load`` times what one
pinned server finishes per second. Reported: each tenant's p99 TTFT in each layout
(``partitioned_light_p99_ms``, ``shared_light_p99_ms``) and the share of the machine's CPU each
layout left idle.

What the CPU analogue models and what it does not: cores are the SMs of a MIG instance, the
fixed KV pool its memory. It does not model the memory-bandwidth partitioning MIG also gives
(the two cores share this socket's memory bandwidth and last-level cache, so a partition here
still leaks some interference), and the load generator runs on the same cores in both layouts.
The simulator answers the same question for a GPU with MIG profiles
(:mod:`labkit.sim.isolation`; ``sim`` in the JSON).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from labkit.bench.common import bench_parser, environment, print_table, write_results

QUICK = {"light_n": 12, "heavy_mult": 10, "max_tokens": 16, "heavy_load": 0.9,
         "num_blocks": 256, "max_num_seqs": 16, "sim_light_rate": 2.0, "sim_seconds": 30.0,
         "sim_profiles": ["3g.40gb", "4g.40gb"], "seed": 0}
FULL = {**QUICK, "light_n": 40, "max_tokens": 32, "sim_seconds": 120.0}
MODEL = "labkit-tiny"


def _cpu_seconds(pid: int) -> float:
    """utime + stime of a process (``/proc/PID/stat``), in seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _servers(layout: str, cfg: dict[str, Any]) -> list[Any]:
    """The two servers: pinned to cores 0 and 1 with one thread each, or free with all cores."""
    from labkit.serve.launcher import free_port
    from labkit.serve.process import ServerProcess, labkit_cmd

    cores = os.cpu_count() or 1
    out = []
    for i in range(2):
        port = free_port()
        cmd = labkit_cmd("serve", MODEL, "--host", "127.0.0.1", "--port", str(port),
                         "--num-blocks", str(cfg["num_blocks"]), "--max-num-seqs",
                         str(cfg["max_num_seqs"]), "--dtype", "float32")
        if layout == "partitioned":
            cmd = ["taskset", "-c", str(i % cores), *cmd]
        srv = ServerProcess(MODEL, port=port, cmd=cmd, name=f"{layout}-{i}",
                            threads=1 if layout == "partitioned" else cores)
        # idle OpenMP threads sleep instead of spinning: two processes of `cores` threads on
        # `cores` cores otherwise burn each other's time slices spin-waiting, an
        # oversubscription collapse (``labkit bench ops cpu-tuning``), not the sharing asked
        srv.env["OMP_WAIT_POLICY"] = "PASSIVE"
        out.append(srv)
    return out


async def _both(urls: list[str], light: list, heavy: list, rate: float, k: int,
                bar: Any) -> tuple:
    from labkit.bench.serve_client import run_load

    extra = {"ignore_eos": True}
    return await asyncio.gather(
        run_load(urls[0], MODEL, light, rate, seed=1, progress=bar, extra=extra),
        run_load(urls[1], MODEL, heavy, rate * k, seed=2, progress=bar, extra=extra))


def _capacity(cfg: dict[str, Any], bar: Any) -> float:
    """Requests/s one pinned single-thread server finishes when never idle."""
    from labkit.bench.serve_client import load, make_requests

    srv = _servers("partitioned", cfg)[1]
    with srv:
        probe = make_requests(4 * cfg["max_num_seqs"], cfg["max_tokens"])
        load(srv.url, MODEL, probe[:2], None)
        res, dur = load(srv.url, MODEL, probe, bar)
    return sum(r.ok for r in res) / dur


def run_layout(layout: str, rate: float, cfg: dict[str, Any], bar: Any) -> dict[str, Any]:
    """Both tenants at once on one layout; TTFT percentiles and CPU use of each server."""
    from labkit.bench.serve_client import load, make_requests, summarize

    k = cfg["heavy_mult"]
    light = make_requests(cfg["light_n"], cfg["max_tokens"], tag="light")
    heavy = make_requests(cfg["light_n"] * k, cfg["max_tokens"], tag="heavy", offset=7)
    servers = _servers(layout, cfg)
    for s in servers:
        s.launch()
    try:
        for s in servers:
            s.wait_ready()
            load(s.url, MODEL, light[:1], None)  # warm-up
        cpu0 = [_cpu_seconds(s.pid) for s in servers]
        t0 = time.perf_counter()
        (lr, ld), (hr, hd) = asyncio.run(_both([s.url for s in servers], light, heavy, rate,
                                               k, bar))
        wall = time.perf_counter() - t0
        cpu = [_cpu_seconds(s.pid) - c for s, c in zip(servers, cpu0)]
    finally:
        for s in servers:
            s.stop()
    sl, sh = summarize(lr, ld), summarize(hr, hd)
    cores = os.cpu_count() or 1
    return {"layout": layout, "light_p99_ms": sl["p99_ttft_ms"], "light_p50_ms":
            sl["p50_ttft_ms"], "heavy_p99_ms": sh["p99_ttft_ms"],
            "heavy_req_s": sh["request_throughput"], "failed": sl["failed"] + sh["failed"],
            "server_cpu_s": cpu, "wall_s": wall,
            "idle_cpu_share": max(0.0, 1 - sum(cpu) / (wall * min(cores, 2)))}


def run_sim(cfg: dict[str, Any]) -> dict[str, Any]:
    """The GPU question on the simulator: Llama-3-8B, light on 3g.40gb and heavy on 4g.40gb of
    an H100, against both time-sliced on the whole GPU."""
    from labkit.sim.isolation import Tenant, compare
    from labkit.sim.workloads import RequestSpec

    def specs(rate: float, seed: int) -> list[RequestSpec]:
        rng = np.random.default_rng(seed)
        n = int(rate * cfg["sim_seconds"])
        t = np.cumsum(rng.exponential(1 / rate, n))
        return [RequestSpec(int(rng.integers(256, 1024)), int(rng.integers(64, 256)),
                            float(t[i]), seed=seed * 100_003 + i) for i in range(n)]

    r = cfg["sim_light_rate"]
    tenants = [Tenant("light", specs(r, cfg["seed"] + 1)),
               Tenant("heavy", specs(r * cfg["heavy_mult"], cfg["seed"] + 2))]
    return {"light_rate_req_s": r, "heavy_rate_req_s": r * cfg["heavy_mult"],
            **compare("llama-3-8b", "h100-sxm", tenants, cfg["sim_profiles"])}


def run(quick: bool = True, sizes: dict[str, Any] | None = None) -> dict[str, Any]:
    if shutil.which("taskset") is None:
        raise RuntimeError("the partitioned layout pins servers with taskset (util-linux)")
    cfg = {**(QUICK if quick else FULL), **(sizes or {})}
    with tqdm(desc="isolation", unit="req") as bar:
        capacity = _capacity(cfg, bar)
        rate = capacity * cfg["heavy_load"] / cfg["heavy_mult"]
        rows = [run_layout(lay, rate, cfg, bar) for lay in ("partitioned", "shared")]
    by = {r["layout"]: r for r in rows}
    return {"benchmark": "ops isolation", "quick": quick, "config": cfg, "model": MODEL,
            "pinned_capacity_req_s": capacity, "light_rate_req_s": rate,
            "heavy_rate_req_s": rate * cfg["heavy_mult"], "rows": rows,
            "partitioned_light_p99_ms": by["partitioned"]["light_p99_ms"],
            "shared_light_p99_ms": by["shared"]["light_p99_ms"],
            "partitioned_idle_cpu_share": by["partitioned"]["idle_cpu_share"],
            "shared_idle_cpu_share": by["shared"]["idle_cpu_share"],
            "sim": run_sim(cfg), "environment": environment()}


def write_chart(payload: dict[str, Any], path: Any) -> None:
    from plotly.subplots import make_subplots

    fig = make_subplots(1, 2, subplot_titles=("this CPU: p99 TTFT (ms)",
                                              "simulated H100, Llama-3-8B: p99 TTFT (ms)"))
    rows, sim = payload["rows"], payload["sim"]
    for tenant in ("light", "heavy"):
        fig.add_bar(x=[r["layout"] for r in rows], y=[r[f"{tenant}_p99_ms"] for r in rows],
                    name=f"{tenant} (CPU)", row=1, col=1)
        fig.add_bar(x=["MIG " + " + ".join(sim["profiles"]), "time-sliced"],
                    y=[sim[f"mig_{tenant}_p99_ms"], sim[f"time_sliced_{tenant}_p99_ms"]],
                    name=f"{tenant} (sim)", row=1, col=2)
    fig.update_layout(title="A light tenant beside a 10x heavier one: partitioned vs shared",
                      barmode="group")
    fig.write_html(str(path), include_plotlyjs="directory")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("ops isolation", __doc__.splitlines()[0])
    args = p.parse_args(argv)
    payload = run(quick=args.quick)
    print_table(payload["rows"], ["layout", "light_p50_ms", "light_p99_ms", "heavy_p99_ms",
                                  "heavy_req_s", "idle_cpu_share", "failed"])
    s = payload["sim"]
    print(f"simulated H100: light p99 MIG {s['mig_light_p99_ms']:.0f} ms vs time-sliced "
          f"{s['time_sliced_light_p99_ms']:.0f} ms; idle compute MIG "
          f"{s['mig_idle_compute']:.0%} vs {s['time_sliced_idle_compute']:.0%}")
    write_results(args.json, payload, write_chart)
    return 0

"""Isolating two tenants on one GPU: MIG slices against time-slicing, simulated.

A provider that puts a light tenant and a heavy one on the same accelerator chooses between
hard partitions and sharing. **MIG** (Multi-Instance GPU, A100/H100/H200) splits the GPU into
instances with their own SMs, memory and memory bandwidth: a ``3g.40gb`` instance of an H100
has 3 of its 7 compute slices and 4 of its 8 memory slices. Nothing one instance does slows
another, but an idle instance's SMs cannot help a busy one. **Time-slicing** (the default when
two processes share a GPU; MPS shares SMs concurrently instead) gives each process the whole GPU
in turns: nothing idles while anyone has work, but a step of the light tenant waits behind the
heavy tenant's step in flight.

Model (stated simplifications): each tenant is a real engine (scheduler, block manager) over
the roofline clock (:mod:`labkit.sim.coarse`). A MIG instance is the GPU preset scaled (peak
FLOP/s by compute slices / 7, bandwidth by memory slices / 8, the profile's memory). Time-slicing
serializes the two engines' steps on the full GPU, round-robin when both have work, with no
context-switch cost, and gives each process half the KV memory (vLLM's
``gpu_memory_utilization`` split). Not modelled: MPS, interference inside one MIG instance's
memory system, the L2 partitioning that makes MIG slices slightly faster than this scaling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from labkit.sim.coarse import add_coarse_request, coarse_engine
from labkit.sim.cost import max_kv_tokens
from labkit.sim.presets import GiB, GPUPreset, get_gpu, get_model_preset
from labkit.sim.workloads import RequestSpec

# (compute slices of 7, memory slices of 8, memory GB): NVIDIA's MIG user guide, "Supported
# MIG Profiles" for H100 80GB and H200 141GB.
MIG_PROFILES: dict[str, dict[str, tuple[int, int, float]]] = {
    "h100-sxm": {"1g.10gb": (1, 1, 10), "1g.20gb": (1, 2, 20), "2g.20gb": (2, 2, 20),
                 "3g.40gb": (3, 4, 40), "4g.40gb": (4, 4, 40), "7g.80gb": (7, 8, 80)},
    "h200-sxm": {"1g.18gb": (1, 1, 18), "1g.35gb": (1, 2, 35), "2g.35gb": (2, 2, 35),
                 "3g.71gb": (3, 4, 71), "4g.71gb": (4, 4, 71), "7g.141gb": (7, 8, 141)},
}


def mig_instance(gpu: str | GPUPreset, profile: str) -> GPUPreset:
    """The GPU preset of one MIG instance: its share of compute, bandwidth and memory."""
    g = get_gpu(gpu)
    table = MIG_PROFILES.get(g.name)
    if table is None:
        raise ValueError(f"no MIG profiles for {g.name}; known: {', '.join(MIG_PROFILES)}")
    if profile not in table:
        raise ValueError(f"{g.name} has no MIG profile {profile!r}; valid: {', '.join(table)}")
    c, m, gb = table[profile]
    return replace(g, name=f"{g.name}:{profile}", peak_flops=g.peak_flops * c / 7,
                   mem_bandwidth=g.mem_bandwidth * m / 8, mem_bytes=int(gb * 1e9),
                   source=f"{g.source}; MIG {profile}: {c}/7 compute, {m}/8 memory slices")


@dataclass
class Tenant:
    name: str
    specs: list[RequestSpec]


def _kv_bytes(model: str, gpu: GPUPreset, share: float = 1.0) -> int:
    m = get_model_preset(model)
    return int(max_kv_tokens(m, gpu) * m.kv_bytes_per_token * share)


def _engine(model: str, gpu: GPUPreset, kv_bytes: int, scale: int) -> Any:
    return coarse_engine(model, gpu, scale=scale, kv_cache_bytes=kv_bytes,
                         enable_prefix_caching=False)


def _collect(engine: Any, tenant: str) -> list[dict[str, Any]]:
    early = engine.executor.first_token_early
    return [{"tenant": tenant, "ttft": t["first_token_time"] - t["arrival_time"]
             - early.get(t["seq_id"], 0.0), "finish": t["finish_time"]}
            for t in engine.request_timings()]


def _replay(engines: list[Any], tenants: list[Tenant], shared: bool) -> float:
    """Replay both tenants' arrivals in time order, each on its engine, as the fleet does (step
    every engine up to an arrival, then add it). ``shared``: the engines are processes on one
    GPU, which runs one step at a time, taking turns when both have work. Returns the seconds
    of GPU work (summed over GPUs when not shared)."""
    free = [0.0] * (1 if shared else len(engines))  # when each GPU is next free
    state = {"turn": 0, "busy": 0.0}

    def advance(until: float) -> None:
        while True:
            ready = [k for k, e in enumerate(engines) if e.has_unfinished_requests()]
            if not ready:
                return
            k = next((j for j in ready if j >= state["turn"]), ready[0])  # round-robin
            if not shared:  # independent GPUs: the one that is furthest behind goes next
                k = min(ready, key=lambda j: max(free[j], engines[j].clock.now()))
            e, g = engines[k], 0 if shared else k
            start = max(free[g], e.clock.now())
            if start >= until:
                return
            e.clock.advance_to(start)
            e.step()
            state["busy"] += e.clock.now() - start
            free[g], state["turn"] = e.clock.now(), (k + 1) % len(engines)

    for t, k, i in _arrivals(tenants):
        advance(t)
        s, eng = tenants[k].specs[i], engines[k]
        if not eng.has_unfinished_requests():
            eng.clock.advance_to(t)  # idle until this arrival
        add_coarse_request(eng, f"{tenants[k].name}{i}", s, t, s.prompt_token_ids(eng.vocab_size))
    advance(math.inf)
    return state["busy"]


def _arrivals(tenants: list[Tenant]) -> list[tuple[float, int, int]]:
    return sorted((s.arrival_time, k, i) for k, t in enumerate(tenants)
                  for i, s in enumerate(t.specs))


def run_partitioned(model: str, tenants: list[Tenant], slices: list[GPUPreset],
                    scale: int = 4) -> tuple[list[dict], list[float]]:
    """Each tenant alone on its own instance (MIG): nothing one does reaches the other."""
    engines = [_engine(model, g, _kv_bytes(model, g), scale) for g in slices]
    _replay(engines, tenants, shared=False)
    rows = [r for e, tn in zip(engines, tenants) for r in _collect(e, tn.name)]
    return rows, [e.executor.busy_s for e in engines]


def run_time_sliced(model: str, tenants: list[Tenant], gpu: GPUPreset,
                    scale: int = 4) -> tuple[list[dict], float]:
    """Both tenants' engines on the whole GPU, one step at a time, taking turns when both have
    work; each engine holds an equal share of the KV memory."""
    engines = [_engine(model, gpu, _kv_bytes(model, gpu, 1 / len(tenants)), scale)
               for _ in tenants]
    busy = _replay(engines, tenants, shared=True)
    return [r for e, tn in zip(engines, tenants) for r in _collect(e, tn.name)], busy


def p99_ms(rows: list[dict], tenant: str) -> float:
    return 1e3 * float(np.percentile([r["ttft"] for r in rows if r["tenant"] == tenant], 99))


def compare(model: str, gpu: str, tenants: list[Tenant], profiles: list[str],
            scale: int = 4) -> dict[str, Any]:
    """Light/heavy tenants' TTFT p99 under MIG (``profiles``, one per tenant) and under
    time-slicing of the whole GPU; and the compute each layout leaves idle over the run."""
    g = get_gpu(gpu)
    slices = [mig_instance(g, p) for p in profiles]
    mig_rows, mig_busy = run_partitioned(model, tenants, slices, scale)
    ts_rows, ts_busy = run_time_sliced(model, tenants, g, scale)
    share = [MIG_PROFILES[g.name][p][0] / 7 for p in profiles]
    # over the same span for both layouts: until the last request of either finishes
    horizon = max(r["finish"] for r in mig_rows + ts_rows)
    out: dict[str, Any] = {"gpu": g.name, "model": model, "profiles": profiles,
                           "kv_gib_per_tenant": {
                               "mig": [_kv_bytes(model, s) / GiB for s in slices],
                               "time-sliced": _kv_bytes(model, g, 0.5) / GiB}}
    for t in tenants:
        out[f"mig_{t.name}_p99_ms"] = p99_ms(mig_rows, t.name)
        out[f"time_sliced_{t.name}_p99_ms"] = p99_ms(ts_rows, t.name)
    out["mig_idle_compute"] = sum(sh * (1 - b / horizon) for sh, b in zip(share, mig_busy))
    out["time_sliced_idle_compute"] = 1 - ts_busy / horizon
    return out

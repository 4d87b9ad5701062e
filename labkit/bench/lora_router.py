"""``labkit bench lora-router``: adapter loads per request, round-robin vs adapter affinity.

Why: a replica serving LoRA holds ``max_loras`` adapters in its device slots; a request whose
adapter is not resident first copies it in (and evicts another, which the next request for
*that* one copies in again). How often that happens is decided by the router: round-robin
hands every replica every adapter, ``adapter-affinity`` (``labkit.router.policies``) keeps
sending an adapter where it already sits, with bounded loads so a hot adapter spills onto
more replicas instead of melting one.

What is measured is a count, not a time (``labkit.sim.adapter_slots``: the router's real policy
classes over replicas whose slots run ``LoRAManager``'s LRU): 4 replicas, 2 slots each,
8 adapters with Zipf popularity (s = 1) and a fifth of the requests on the base model, one
request arriving per tick and running 4 to 12 ticks (about 8 in flight, 2 per replica). Each
policy gets the same seeded requests; the numbers are deterministic, so a test asserts them.

Columns: ``loads_per_request`` (slot loads / adapter requests; 1/8 of a load per request
means an adapter is copied in once per eight requests), ``waited`` (requests that found every
slot busy with running adapters, so waited for one), and ``peak_outstanding`` (the most
requests one replica held: what the load bound protects). ``affinity_vs_round_robin`` is round
robin's loads per request over adapter affinity's (default bound).
"""

from __future__ import annotations

from typing import Any

from labkit.bench.common import bench_parser, environment, print_table, write_results
from labkit.router.policies import get_policy
from labkit.sim.adapter_slots import adapter_workload, simulate_adapter_fleet

SETUP = {"num_replicas": 4, "max_loras": 2, "num_adapters": 8, "zipf_s": 1.0,
         "base_fraction": 0.2, "min_ticks": 4, "max_ticks": 12}
POLICIES: list[tuple[str, str, dict[str, Any]]] = [
    ("round-robin", "round-robin", {}),
    ("least-outstanding", "least-outstanding", {}),
    ("adapter-affinity", "adapter-affinity", {}),
    ("adapter-affinity min_load=4", "adapter-affinity", {"min_load": 4}),
    ("adapter-affinity unbounded", "adapter-affinity", {"eps": None}),
]


def run(num_requests: int = 4000, seed: int = 0) -> dict[str, Any]:
    """Every policy of :data:`POLICIES` over the same seeded workload (:data:`SETUP`)."""
    s = SETUP
    work = adapter_workload(num_requests, s["num_adapters"], s["zipf_s"], s["base_fraction"],
                            s["min_ticks"], s["max_ticks"], seed=seed)
    rows = []
    for label, name, kw in POLICIES:
        if name == "adapter-affinity":
            kw = {"max_loras": s["max_loras"], **kw}
        r = simulate_adapter_fleet(get_policy(name, **kw), work, s["num_replicas"],
                                   s["max_loras"])
        rows.append({"policy": label, "loads_per_request": round(r["loads_per_request"], 4),
                     "slot_loads": r["slot_loads"], "waited": r["waited_for_slot"],
                     "peak_outstanding": max(x["peak_outstanding"] for x in r["replicas"]),
                     "routed_per_replica": [x["routed"] for x in r["replicas"]],
                     "adapters_per_replica": [x["adapters_seen"] for x in r["replicas"]]})
    by = {r["policy"]: r for r in rows}
    return {"bench": "lora-router", "setup": {**s, "num_requests": num_requests, "seed": seed},
            "rows": rows, "lora_requests": sum(a is not None for a, _ in work),
            "affinity_vs_round_robin": round(by["round-robin"]["loads_per_request"]
                                             / by["adapter-affinity"]["loads_per_request"], 3),
            "environment": environment()}


def write_chart(payload: dict[str, Any], path: Any) -> None:
    """Bars of loads per request by policy (beside the JSON)."""
    import plotly.graph_objects as go

    rows = payload["rows"]
    fig = go.Figure(go.Bar(x=[r["policy"] for r in rows],
                           y=[r["loads_per_request"] for r in rows]))
    fig.update_layout(title="Adapter slot loads per LoRA request (4 replicas x 2 slots, "
                            "8 Zipf adapters)", yaxis_title="slot loads / request")
    fig.write_html(str(path), include_plotlyjs="directory")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("lora-router", __doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--requests", type=int, default=None, help="default 4000 (--quick: 1000)")
    args = p.parse_args(argv)
    n = args.requests or (1000 if args.quick else 4000)
    payload = run(n, args.seed)
    print_table(payload["rows"], ["policy", "loads_per_request", "slot_loads", "waited",
                                  "peak_outstanding"])
    print(f"\nround-robin copies adapters in {payload['affinity_vs_round_robin']:.1f}x as "
          f"often as adapter-affinity ({payload['lora_requests']} LoRA requests)")
    write_results(args.json, payload, write_chart)
    return 0

"""``labkit bench disagg``: does prefill/decode disaggregation remove prefill interference here?

The claim disaggregation makes (DistServe, Splitwise): when long prompts arrive while short chats
are streaming, a colocated instance runs the long prefills in the same steps as the chats'
decodes, so the chats' inter-token latency (ITL) spikes; a separate decode instance never runs a
long prefill (its prompt KV arrives by transfer), so its streams stay smooth. The price: every
request makes two hops and its prompt KV crosses a link.

The experiment, the same seeded workload on two setups of two instances each:

- **colocated**: ``labkit cluster up 2`` (round-robin): each instance prefills and decodes;
- **disaggregated**: ``labkit cluster up --prefill 1 --decode 1`` (:mod:`labkit.router.disagg`).

Short chats (a short prompt, many tokens, streamed) arrive as a Poisson stream and long prompts
(few output tokens) arrive among them. Reported for the short chats: TTFT p50/p99 and ITL
p50/p99, from the client; for the run: the KV bytes the prefill instance pushed against the
formula (``full prompt blocks x block_size x layers x 2 x kv_heads x head_dim x 4`` bytes,
float32), and ``outputs_match`` (every request's greedy text equal across both setups and to
``labkit.LLM``'s offline generation).

On 2 CPU cores the two setups do not have what disaggregation assumes: the "instances" share the
same two cores, so a long prefill on the prefill instance still takes CPU from the decode
instance. The honest result may be that disaggregation loses here; the simulator's answer for
GPUs with their own compute is beside it (``labkit.sim.disagg`` when present).
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from labkit.bench.common import bench_parser, environment, print_table, write_results
from labkit.bench.serve_client import BenchRequest, load, summarize

QUICK = {"short": 8, "long": 3, "short_tokens": 24, "long_tokens": 4, "long_len": 360,
         "rate": 4.0}
FULL = {"short": 24, "long": 8, "short_tokens": 48, "long_tokens": 4, "long_len": 700,
        "rate": 3.0}
REPLICA_ARGS = ("--num-blocks", "512", "--max-num-seqs", "16", "--dtype", "float32",
                "--block-size", "16", "--max-num-batched-tokens", "1024")
MODEL = "labkit-tiny"


def workload(cfg: dict[str, Any], seed: int = 0) -> list[BenchRequest]:
    """Short chats and long prompts, shuffled (seeded) into one arrival order."""
    from labkit.sim.workloads import prompt_texts

    texts = prompt_texts("code_prompts")
    rng = random.Random(seed)
    short = [BenchRequest(texts[i % len(texts)], cfg["short_tokens"], tag="short")
             for i in range(cfg["short"])]
    long_text = "\n".join(texts)
    longs = []
    for _ in range(cfg["long"]):
        start = rng.randrange(len(long_text) // 2)
        longs.append(BenchRequest(long_text[start:start + cfg["long_len"] * 4],
                                  cfg["long_tokens"], tag="long"))
    reqs = short + longs
    rng.shuffle(reqs)
    return reqs


def _run_setup(cluster: Any, reqs: list[BenchRequest], cfg: dict[str, Any], bar: Any
               ) -> tuple[list[Any], dict[str, Any]]:
    with cluster as c:
        results, duration = load(c.url, MODEL, reqs, bar, rate=cfg["rate"], seed=1)
        extra = {}
        if hasattr(c, "prefill"):
            import httpx

            from labkit.serve.metrics import parse_metrics

            m = parse_metrics(httpx.get(c.prefill[0].url + "/metrics", timeout=10).text)
            extra = {"kv_blocks_pushed": m.get("labkit:kv_transfer_blocks_total", 0.0),
                     "kv_bytes_pushed": m.get("labkit:kv_transfer_bytes_total", 0.0),
                     "proxy": c.state()}
    short = [r for r in results if r.tag == "short"]
    s = summarize(short, duration, percentiles=(50, 99))
    row = {"ttft_p50_ms": s["p50_ttft_ms"], "ttft_p99_ms": s["p99_ttft_ms"],
           "itl_p50_ms": s["p50_itl_ms"], "itl_p99_ms": s["p99_itl_ms"],
           "failed": sum(not r.ok for r in results), "duration_s": duration, **extra}
    return results, row


def kv_bytes_formula(prompts: list[str], block_size: int = 16) -> tuple[int, int]:
    """(full prompt blocks pushed, their bytes) for ``prompts`` on labkit-tiny in float32:
    ``(tokens - 1) // block_size`` blocks each (the last token is always computed), of
    ``block_size x layers x 2 (K, V) x kv_heads x head_dim x 4`` bytes."""
    from labkit.model.loader import load_pretrained

    model, tok = load_pretrained(MODEL)
    c = model.config
    per_block = block_size * c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4
    blocks = sum((len(tok.encode(p)) - 1) // block_size for p in prompts)
    return blocks, blocks * per_block


def reference_texts(reqs: list[BenchRequest]) -> list[str]:
    import torch

    from labkit import LLM, SamplingParams

    llm = LLM(model=MODEL, dtype=torch.float32, device="cpu", block_size=16)
    outs = llm.generate([r.prompt for r in reqs], [SamplingParams(
        temperature=0, max_tokens=r.max_tokens, ignore_eos=True) for r in reqs], use_tqdm=False)
    return [o.outputs[0].text for o in outs]


def run(quick: bool = True, sizes: dict[str, Any] | None = None, seed: int = 0
        ) -> dict[str, Any]:
    from labkit.router.cluster import Cluster
    from labkit.router.pd_cluster import PDCluster

    cfg = {**(QUICK if quick else FULL), **(sizes or {})}
    reqs = workload(cfg, seed)
    with tqdm(total=2 * len(reqs) + 2, desc="bench disagg") as bar:
        colo, colo_row = _run_setup(Cluster(2, MODEL, "round-robin", REPLICA_ARGS,
                                            probe_interval=1.0), reqs, cfg, bar)
        pd, pd_row = _run_setup(PDCluster(1, 1, MODEL, REPLICA_ARGS), reqs, cfg, bar)
        ref = reference_texts(reqs)
        bar.update(1)
        blocks, nbytes = kv_bytes_formula([r.prompt for r in reqs])
        bar.update(1)
    match = all(a.ok and b.ok and a.text == b.text == t for a, b, t in zip(colo, pd, ref))
    return {"benchmark": "disagg", "quick": quick, "model": MODEL, "config": cfg,
            "replica_args": list(REPLICA_ARGS), "num_requests": len(reqs),
            "colocated": colo_row, "disaggregated": pd_row, "outputs_match": match,
            "kv_blocks_formula": blocks, "kv_bytes_formula": nbytes,
            "kv_bytes_match_formula": pd_row.get("kv_bytes_pushed") == nbytes,
            "short_itl_p99_ratio": pd_row["itl_p99_ms"] / colo_row["itl_p99_ms"],
            "short_ttft_p50_ratio": pd_row["ttft_p50_ms"] / colo_row["ttft_p50_ms"],
            "environment": environment()}


def write_chart(payload: dict[str, Any], path: Path) -> None:
    import plotly.graph_objects as go

    keys = ["ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"]
    fig = go.Figure()
    for name in ("colocated", "disaggregated"):
        fig.add_bar(name=name, x=keys, y=[payload[name][k] for k in keys])
    fig.update_layout(title="short chats beside long prompts: colocated (2 instances) vs "
                      "1 prefill + 1 decode", yaxis_title="ms", barmode="group")
    fig.write_html(path, include_plotlyjs="cdn")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("disagg", __doc__.splitlines()[0])
    args = p.parse_args(argv)
    payload = run(quick=args.quick)
    rows = [{"setup": n, **{k: payload[n][k] for k in ("ttft_p50_ms", "ttft_p99_ms",
                                                       "itl_p50_ms", "itl_p99_ms", "failed")}}
            for n in ("colocated", "disaggregated")]
    print_table(rows)
    print(f"disaggregated/colocated: short-chat ITL p99 {payload['short_itl_p99_ratio']:.2f}x, "
          f"TTFT p50 {payload['short_ttft_p50_ratio']:.2f}x; KV pushed "
          f"{payload['disaggregated'].get('kv_bytes_pushed', 0):.0f} B (formula "
          f"{payload['kv_bytes_formula']}); outputs_match = {payload['outputs_match']}")
    write_results(args.json, payload, write_chart)
    return 0 if payload["outputs_match"] else 1

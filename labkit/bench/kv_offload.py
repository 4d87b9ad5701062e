"""``labkit bench kv-offload``: a multi-turn chat through no caching, the device prefix cache,
and the offloading connector's CPU and CPU + disk tiers.

Why: in a chat every turn's prompt is the whole history plus one new message, so almost all of
it was computed before, by the previous turn. Whether that KV is still around decides the
prefill: the device pool holds only a few conversations, and once other users' turns have
evicted a conversation's blocks, device-only prefix caching recomputes them. A CPU tier (host
memory, LRU) and a disk tier below it keep what the device evicts and load it back instead
(vLLM's offloading connector, LMCache, SGLang's HiRadix cache). This bench measures what each
buys on one seeded workload:

- ``conversations`` chats share one system prompt; each turn appends a user message of
  ``user_len`` seeded random tokens and the model's greedy reply (``max_tokens``). Turns run
  round-robin over conversations (every chat's turn 1, then every chat's turn 2, ...), so
  between two turns of one chat all the others run: their histories exceed the device pool
  (``num_blocks`` is sized to one request plus two blocks) several times.
- Requests run one at a time. TTFT is then the request's own prefill and loads, with no
  queueing, and - the point of the hit-rate ordering below - the device pool sees the same
  allocations and frees in every configuration (a loaded block is published in the device
  prefix cache like a computed one), so a tier can only extend the device match, never shrink
  it: hit rate(device-only) <= hit rate(+ any tier). A store that never evicts (the disk
  configuration: a small CPU tier, a disk tier sized for every block) holds every full block
  ever computed, so its hit rate is the most any cache could reach on this request order,
  ``ideal_hit_tokens``, computed from the token sequences alone.

Per configuration: ``hit_rate`` = cached tokens (device hits + blocks loaded from a tier) /
prompt tokens; ``computed_prefill_tokens`` = prompt tokens the model ran (from the engine's
trace: load-independent, the number to trust on a busy machine); TTFT p50 (wall, all requests
and turns after the first) and total wall. ``outputs_match``: every configuration's greedy
tokens equal the no-caching run's, token for token. On the tiny CPU model a recomputed block is
cheap, so a tier's load (a copy, or a file read plus a sha256 check) can cost as much as the
recompute it saves: the wall ratios say which; on a GPU with an 8B model the prefill is the
expensive side (the simulator's roofline).
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from labkit.bench.common import bench_parser, environment, greedy_params, print_table, write_results

QUICK = {"conversations": 4, "turns": 3, "system_len": 32, "user_len": 24, "max_tokens": 8,
         "block_size": 16}
FULL = {"conversations": 8, "turns": 5, "system_len": 64, "user_len": 48, "max_tokens": 16,
        "block_size": 16}
CONFIGS = ("no-cache", "device", "device+cpu", "device+cpu+disk")


def final_len(cfg: dict[str, Any]) -> int:
    """Tokens of a conversation's last prompt plus its reply (the longest request)."""
    return cfg["system_len"] + cfg["turns"] * (cfg["user_len"] + cfg["max_tokens"])


def pool_blocks(cfg: dict[str, Any]) -> int:
    """Device pool: the longest request's blocks plus two (so one request always fits)."""
    return -(-final_len(cfg) // cfg["block_size"]) + 2


def messages(cfg: dict[str, Any], vocab: int, seed: int) -> tuple[list[int], list[list[list[int]]]]:
    """The shared system prompt and each conversation's user messages (seeded random ids)."""
    g = torch.Generator().manual_seed(seed)
    ids = lambda n: torch.randint(1, vocab, (n,), generator=g).tolist()  # noqa: E731
    system = ids(cfg["system_len"])
    return system, [[ids(cfg["user_len"]) for _ in range(cfg["turns"])]
                    for _ in range(cfg["conversations"])]


def _connector(name: str, block_bytes: int, unique_blocks: int, tmp: str) -> Any:
    """The tier sizes: ``device+cpu`` holds half the workload's blocks (so its LRU evicts);
    ``device+cpu+disk`` a CPU tier of an eighth, spilling to a disk tier that holds all of
    them (file sizes include safetensors' header, hence the factor 2)."""
    from labkit.kv.connector import OffloadingConnector

    if name == "device+cpu":
        return OffloadingConnector(cpu_bytes=block_bytes * max(1, unique_blocks // 2))
    if name == "device+cpu+disk":
        return OffloadingConnector(cpu_bytes=block_bytes * max(1, unique_blocks // 8),
                                   disk_dir=tmp, disk_bytes=2 * block_bytes * unique_blocks)
    return None


def _prefill_tokens(trace: dict[str, Any]) -> int:
    return sum(s["num_tokens"] for rec in trace["steps"] for s in rec["scheduled"]
               if s["phase"] == "prefill")


def run_config(model: Any, name: str, cfg: dict[str, Any], system: list[int],
               users: list[list[list[int]]], tmp: str) -> dict[str, Any]:
    """The whole workload through one fresh engine; per-request TTFT, outputs, cached tokens."""
    from labkit import LLM
    from labkit.kv.cache import kv_bytes_per_block

    bs, nb = cfg["block_size"], pool_blocks(cfg)
    c = model.config
    block_bytes = kv_bytes_per_block(c.num_hidden_layers, bs, c.num_key_value_heads,
                                     c.head_dim, model.dtype)
    unique = len(users) * -(-final_len(cfg) // bs)
    conn = _connector(name, block_bytes, unique, tmp)
    llm = LLM.from_model(model, block_size=bs, num_blocks=nb, max_num_seqs=1,
                         enable_prefix_caching=name != "no-cache", kv_connector=conn)
    engine, params = llm.llm_engine, greedy_params(cfg["max_tokens"])
    history = [list(system) for _ in users]
    outputs, rows = [], []
    t0 = time.perf_counter()
    for turn in range(cfg["turns"]):
        for c, msgs in enumerate(users):
            prompt = history[c] + msgs[turn]
            out = llm.generate(prompt_token_ids=[prompt], sampling_params=params)[0]
            t = next(x for x in engine.request_timings() if x["request_id"] == out.request_id)
            reply = list(out.outputs[0].token_ids)
            outputs.append(reply)
            history[c] = prompt + reply
            rows.append({"turn": turn, "prompt_len": len(prompt),
                         "cached": t["num_cached_tokens"],
                         "ttft_s": t["first_token_time"] - t["arrival_time"]})
    wall = time.perf_counter() - t0
    stats = engine.stats()
    prompt_tokens = sum(r["prompt_len"] for r in rows)
    cached = sum(r["cached"] for r in rows)
    later = [r["ttft_s"] for r in rows if r["turn"] > 0] or [r["ttft_s"] for r in rows]
    res = {"config": name, "requests": len(rows), "prompt_tokens": prompt_tokens,
           "cached_tokens": cached, "hit_rate": cached / prompt_tokens,
           "device_hit_tokens": stats.get("prefix_hit_tokens", 0),
           "computed_prefill_tokens": _prefill_tokens(engine.trace.to_dict()),
           "ttft_p50_s": statistics.median(r["ttft_s"] for r in rows),
           "ttft_p50_later_turns_s": statistics.median(later), "wall_s": wall,
           "outputs": outputs, "prompts": [r["prompt_len"] for r in rows]}
    if conn is not None:
        res["tiers"] = stats["kv_connector"]
        conn.close()
    return res


def warmup(model: Any, cfg: dict[str, Any]) -> None:
    """One longest-length request through a throwaway engine, untimed: the first forward in a
    process pays one-time costs (allocator growth, lazy initialisation) that would otherwise
    land on whichever configuration runs first."""
    from labkit import LLM

    llm = LLM.from_model(model, block_size=cfg["block_size"], num_blocks=pool_blocks(cfg))
    prompt = [1 + i % (model.config.vocab_size - 1) for i in range(final_len(cfg) -
                                                                 cfg["max_tokens"])]
    llm.generate(prompt_token_ids=[prompt], sampling_params=greedy_params(cfg["max_tokens"]))


def ideal_hit_tokens(prompts: list[list[int]], replies: list[list[int]], block_size: int) -> int:
    """The most tokens any prefix cache could serve on this request order, from the tokens
    alone: a prompt's leading full blocks (never its last token) whose whole prefix some earlier
    request filled (its prompt and every reply token but the last, which is never run)."""
    seen: set[tuple[int, ...]] = set()
    total = 0
    for prompt, reply in zip(prompts, replies):
        n = 0
        while (n + 1) * block_size <= len(prompt) - 1 and \
                tuple(prompt[:(n + 1) * block_size]) in seen:
            n += 1
        total += n * block_size
        filled = prompt + reply[:-1]
        for i in range(1, len(filled) // block_size + 1):
            seen.add(tuple(filled[:i * block_size]))
    return total


def rebuild_prompts(system: list[int], users: list[list[list[int]]],
                    replies: list[list[int]]) -> list[list[int]]:
    """The prompts in run order, from the messages and a run's replies (same order)."""
    history, out, k = [list(system) for _ in users], [], 0
    for turn in range(len(users[0])):
        for c, msgs in enumerate(users):
            prompt = history[c] + msgs[turn]
            out.append(prompt)
            history[c] = prompt + replies[k]
            k += 1
    return out


def run(model: str | Path = "labkit-tiny", quick: bool = True,
        sizes: dict[str, Any] | None = None, seed: int = 0) -> dict[str, Any]:
    from labkit.model.loader import load_pretrained, resolve_model_path

    cfg = {**(QUICK if quick else FULL), **(sizes or {})}
    m, _ = load_pretrained(resolve_model_path(model), dtype=torch.float32)
    system, users = messages(cfg, m.config.vocab_size, seed)
    warmup(m, cfg)
    tmp = tempfile.mkdtemp(prefix="labkit-kv-bench-")
    try:
        res = {n: run_config(m, n, cfg, system, users, tmp) for n in CONFIGS}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    base = res["no-cache"]
    prompts = rebuild_prompts(system, users, base["outputs"])
    ideal = ideal_hit_tokens(prompts, base["outputs"], cfg["block_size"])
    match = all(r["outputs"] == base["outputs"] for r in res.values())
    rows = [{k: v for k, v in r.items() if k not in ("outputs", "prompts")} for r in res.values()]
    rec = res["device"]
    ratio = lambda a, b: res[a]["ttft_p50_later_turns_s"] / res[b]["ttft_p50_later_turns_s"]  # noqa: E731
    unique = len(users) * -(-final_len(cfg) // cfg["block_size"])
    return {
        "benchmark": "kv-offload", "model": str(model), "quick": quick, "sizes": cfg,
        "device_pool_blocks": pool_blocks(cfg), "workload_blocks": unique,
        "workload_over_pool": unique / pool_blocks(cfg),
        "outputs_match": match, "ideal_hit_tokens": ideal,
        "ideal_hit_rate": ideal / base["prompt_tokens"],
        "hit_rate": {r["config"]: r["hit_rate"] for r in rows},
        "computed_prefill_tokens": {r["config"]: r["computed_prefill_tokens"] for r in rows},
        "ttft_p50_s": {r["config"]: r["ttft_p50_s"] for r in rows},
        "cpu_tier_vs_recompute_ttft": ratio("device+cpu", "device"),
        "disk_tier_vs_recompute_ttft": ratio("device+cpu+disk", "device"),
        "device_vs_no_cache_ttft": ratio("device", "no-cache"),
        "recompute_tokens_saved_by_cpu": rec["computed_prefill_tokens"]
        - res["device+cpu"]["computed_prefill_tokens"],
        "configs": rows, "environment": environment(),
    }


def write_chart(payload: dict[str, Any], path: Path) -> None:
    from plotly.subplots import make_subplots

    rows = payload["configs"]
    names = [r["config"] for r in rows]
    fig = make_subplots(rows=1, cols=3, subplot_titles=(
        "prefix hit rate (cached / prompt tokens)", "prefill tokens computed",
        "TTFT P50, turns after the first (ms, wall)"))
    fig.add_bar(x=names, y=[r["hit_rate"] for r in rows], row=1, col=1, showlegend=False)
    fig.add_hline(y=payload["ideal_hit_rate"], line_dash="dot", row=1, col=1,
                  annotation_text="every block ever computed")
    fig.add_bar(x=names, y=[r["computed_prefill_tokens"] for r in rows], row=1, col=2,
                showlegend=False)
    fig.add_bar(x=names, y=[1e3 * r["ttft_p50_later_turns_s"] for r in rows], row=1, col=3,
                showlegend=False)
    fig.update_layout(title=f"Multi-turn chat, {payload['workload_over_pool']:.1f}x the device "
                      f"KV pool: {payload['model']} on {payload['environment']['cpu_model']}")
    fig.write_html(str(path), include_plotlyjs="directory")
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("kv-offload", __doc__.splitlines()[0])
    p.add_argument("--model", default="labkit-tiny", help="shipped model name or folder")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    payload = run(args.model, quick=args.quick, seed=args.seed)
    print(f"\n{payload['model']}: {payload['sizes']['conversations']} conversations x "
          f"{payload['sizes']['turns']} turns, {payload['workload_blocks']} blocks of history "
          f"against a device pool of {payload['device_pool_blocks']}")
    print_table(payload["configs"], ["config", "hit_rate", "computed_prefill_tokens",
                                     "ttft_p50_s", "ttft_p50_later_turns_s", "wall_s"])
    print(f"\nideal hit rate {payload['ideal_hit_rate']:.3f}; outputs_match "
          f"{payload['outputs_match']}; TTFT (later turns) +CPU / recompute "
          f"{payload['cpu_tier_vs_recompute_ttft']:.2f}x, +disk / recompute "
          f"{payload['disk_tier_vs_recompute_ttft']:.2f}x")
    write_results(args.json, payload, write_chart)
    return 0

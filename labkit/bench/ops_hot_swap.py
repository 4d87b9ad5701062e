"""``labkit bench ops hot-swap``: new weights into a serving replica; lost requests, stale KV.

A replica of ``labkit serve`` (a tiny seeded Llama checkpoint, thread engine) serves requests
while its weights are swapped in place through ``POST /v1/admin/update_weights``
(:mod:`labkit.serve.weight_routes`). Per round: ``cached`` prompts are served first (their
prefix blocks sit in the prefix cache under the old weights), then ``concurrent`` long requests
are started, and once they decode the weights are swapped; afterwards the cached prompts are
asked again. Counted:

- ``lost_requests``: requests in flight at the swap that did not complete with all their tokens
  (labkit recomputes them under the new weights: must be 0); ``invalid_results``: completed ones
  whose tokens are not the old model's up to some point and the new model's after it;
- ``stale_kv_served``: answers after the swap that differ from a fresh model loaded with the new
  weights (``labkit.model.generate``). The versioned prefix-cache key must give 0; the same run
  with the version left out of the key (``key_by_version=False``, the bug kept as a demo) is the
  negative control, and reports how many answers were built on the old model's KV (there the
  recomputed in-flight requests also pick up their own old blocks: ``invalid_results`` too);
- ``pause_ms``: how long the engine loop stood still for the swap (read, check, copy, requeue).

Correctness counts do not depend on the machine; ``pause_ms`` does (the load average at the
start is in ``environment``).
"""

from __future__ import annotations

import functools
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from operator import methodcaller
from pathlib import Path
from typing import Any

import httpx

from labkit.bench.common import bench_parser, environment, print_table, write_results

QUICK = {"rounds": 1, "concurrent": 6, "cached": 6, "max_tokens": 48, "check_tokens": 8,
         "prompt_len": 13, "block_size": 4, "seed": 0}
FULL = {**QUICK, "rounds": 4, "concurrent": 12, "cached": 12, "max_tokens": 96}


def _prompts(n: int, length: int, offset: int) -> list[list[int]]:
    return [[(7 * i + 3 + 11 * (j + offset)) % 128 for i in range(length)] for j in range(n)]


def _complete(url: str, prompt: list[int], n: int) -> list[int] | None:
    """Greedy tokens, or None when the request did not complete with all ``n`` of them."""
    try:
        r = httpx.post(url + "/v1/completions", timeout=300, json={
            "model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True})
        choice = r.json()["choices"][0] if r.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    ok = choice and choice["finish_reason"] == "length" and len(choice["token_ids"]) == n
    return choice["token_ids"] if ok else None


def spans_the_swap(got: list[int], prompt: list[int], old: Any, new: Any) -> bool:
    """Some k: the first k tokens are ``old``'s greedy answer, the rest ``new``'s from there."""
    from labkit.model.generate import generate

    ref = generate(old, prompt, len(got))
    lcp = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(got))
    # k = len(got): all of it is old's answer (it finished before the swap reached it)
    return any(k == len(got) or got[k:] == generate(new, prompt + got[:k], len(got) - k)
               for k in range(lcp, -1, -1))


def _unversioned_update(path: str, version: str, engine: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    info = engine.update_weights(path, version, key_by_version=False)
    return {**info, "pause_ms": 1e3 * (time.perf_counter() - t0)}


def _swap(srv: Any, path: Path, version: str, versioned: bool) -> dict[str, Any]:
    if not versioned:  # the bug, reachable only from inside the engine core
        return srv.call(functools.partial(_unversioned_update, str(path), version))
    r = httpx.post(srv.url + "/v1/admin/update_weights", timeout=300,
                   json={"path": str(path), "version": version})
    r.raise_for_status()
    return r.json()


def run_round(srv: Any, cfg: dict[str, Any], folders: list[Path], models: list[Any],
              rnd: int, versioned: bool) -> dict[str, Any]:
    """One swap from ``folders[rnd % 2]``'s weights to the other's, under load."""
    from labkit.model.generate import generate

    old, new = models[rnd % 2], models[(rnd + 1) % 2]
    cached = _prompts(cfg["cached"], cfg["prompt_len"], 100 * rnd)
    for p in cached:  # their full blocks are now in the prefix cache, old weights
        _complete(srv.url, p, cfg["check_tokens"])
    live = _prompts(cfg["concurrent"], cfg["prompt_len"], 100 * rnd + 50)
    with ThreadPoolExecutor(len(live)) as pool:
        futs = [pool.submit(_complete, srv.url, p, cfg["max_tokens"]) for p in live]
        deadline = time.monotonic() + 60
        while srv.call(methodcaller("stats"))["num_running"] < 1 and \
                time.monotonic() < deadline:
            time.sleep(0.002)
        info = _swap(srv, folders[(rnd + 1) % 2], f"v{rnd + 1}", versioned)
        got = [f.result() for f in futs]
    n = cfg["check_tokens"]
    after = [_complete(srv.url, p, n) for p in cached]
    return {"round": rnd, "key": "versioned" if versioned else "unversioned",
            "in_flight": len(live), "num_recomputed": info["num_recomputed"],
            "lost_requests": sum(g is None for g in got),
            "invalid_results": sum(g is not None and not spans_the_swap(g, p, old, new)
                                   for g, p in zip(got, live)),
            "stale_kv_served": sum(a != generate(new, p, n) for a, p in zip(after, cached)),
            "pause_ms": info["pause_ms"]}


def run_arm(cfg: dict[str, Any], folders: list[Path], versioned: bool) -> list[dict[str, Any]]:
    """A fresh replica on ``folders[0]``, ``rounds`` swaps between the two folders."""
    from labkit.model.loader import load_model
    from labkit.serve.api_server import ServeConfig
    from labkit.serve.engine_core import build_engine
    from labkit.serve.launcher import ServerThread

    models = [load_model(f) for f in folders]
    eng, tok, _ = build_engine(str(folders[0]), dtype="float32", device="cpu",
                               block_size=cfg["block_size"], num_blocks=512,
                               max_num_seqs=max(8, cfg["concurrent"]))
    with ServerThread(eng, tok, ServeConfig(model_name="m")) as srv:
        return [run_round(srv, cfg, folders, models, r, versioned)
                for r in range(cfg["rounds"])]


def run(quick: bool = True, sizes: dict[str, Any] | None = None) -> dict[str, Any]:
    from labkit.model.testing import tiny_llama_checkpoint

    cfg = {**(QUICK if quick else FULL), **(sizes or {})}
    with tempfile.TemporaryDirectory(prefix="labkit-hot-swap-") as d:
        folders = [tiny_llama_checkpoint(Path(d) / f"w{i}", cfg["seed"] + i) for i in (0, 1)]
        rows = run_arm(cfg, folders, True) + run_arm(cfg, folders, False)
    arm = {k: [r for r in rows if r["key"] == k] for k in ("versioned", "unversioned")}
    tot = lambda k, key: sum(r[key] for r in arm[k])  # noqa: E731
    return {"benchmark": "ops hot-swap", "quick": quick, "config": cfg, "rows": rows,
            "lost_requests": tot("versioned", "lost_requests"),
            "invalid_results": tot("versioned", "invalid_results"),
            "stale_kv_served": tot("versioned", "stale_kv_served"),
            "unversioned_stale_kv_served": tot("unversioned", "stale_kv_served"),
            "unversioned_lost_requests": tot("unversioned", "lost_requests"),
            "unversioned_invalid_results": tot("unversioned", "invalid_results"),
            "cached_prompts_checked": cfg["rounds"] * cfg["cached"],
            "pause_ms": [r["pause_ms"] for r in arm["versioned"]],
            "environment": environment()}


def write_chart(payload: dict[str, Any], path: Any) -> None:
    from plotly.subplots import make_subplots

    fig = make_subplots(rows=1, cols=2, subplot_titles=(
        "answers after the swap built on the old model's KV", "engine pause per swap (ms)"))
    keys = ("versioned", "unversioned")
    for what in ("stale_kv_served", "lost_requests"):
        fig.add_bar(x=[f"{k} key" for k in keys], name=what, row=1, col=1,
                    y=[sum(r[what] for r in payload["rows"] if r["key"] == k) for k in keys])
    for k in keys:
        pts = [r for r in payload["rows"] if r["key"] == k]
        fig.add_scatter(x=[r["round"] for r in pts], y=[r["pause_ms"] for r in pts],
                        name=f"pause ({k})", mode="lines+markers", row=1, col=2)
    fig.update_layout(title=f"hot weight swap under load, of {payload['cached_prompts_checked']}"
                      " cached prompts asked again")
    fig.write_html(str(path), include_plotlyjs="directory")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("ops hot-swap", __doc__.splitlines()[0])
    args = p.parse_args(argv)
    payload = run(quick=args.quick)
    print_table(payload["rows"], ["round", "key", "in_flight", "num_recomputed",
                                  "lost_requests", "invalid_results", "stale_kv_served",
                                  "pause_ms"])
    print(f"versioned key: lost {payload['lost_requests']}, stale {payload['stale_kv_served']}"
          f" of {payload['cached_prompts_checked']}; unversioned (the bug): stale "
          f"{payload['unversioned_stale_kv_served']}")
    write_results(args.json, payload, write_chart)
    return 0

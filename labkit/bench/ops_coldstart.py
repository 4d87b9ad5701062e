"""``labkit bench ops cold-start``: a new replica's time to its first token, weights from S3.

A replica that scales up from zero is idle until its weights arrive. The experiment puts a
random ~100 M-parameter Llama (float32, 0.4 GB; ``--quick``: a 4 M one) in a real S3 server on
loopback (moto's, :mod:`labkit.bench.s3_loopback`) behind a throttle that holds each connection
to ``per_conn_mbps`` and the node to ``total_mbps``, then starts a fresh Python process per
way of loading and times, from the process's start, its imports, its weights and its first
generated token:

* ``sequential``: one GET per object into the node-local cache, then a normal load;
* ``ranged``: parallel ranged GETs (8 connections, 8 MiB parts), then a normal load;
  (the checkpoint is sharded, 32 MB per file, as Hugging Face checkpoints are);
* ``stream``: tensors streamed from ranged GETs straight into the model, no disk;
* ``cache-hit``: the node-local copy is current, nothing is fetched.

Every way must generate what the model loaded from its local folder generates (greedy,
``outputs_match``). What the loopback does not model: network latency, the store's request-rate
limits, a GPU's host-to-device copy; the per-connection and node rates are stated in the JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from labkit.bench.common import bench_parser, environment, print_table, write_results

QUICK = {"hidden": 256, "intermediate": 704, "layers": 4, "heads": 8, "kv_heads": 2,
         "per_conn_mbps": 200.0, "total_mbps": 1600.0, "part_mib": 1, "connections": 8,
         "tokens": 8, "seed": 0, "shard_mb": 4}
FULL = {**QUICK, "hidden": 768, "intermediate": 2048, "layers": 16, "heads": 12, "kv_heads": 4,
        "per_conn_mbps": 400.0, "total_mbps": 3200.0, "part_mib": 8, "shard_mb": 32}
MODES = ("sequential", "ranged", "stream", "cache-hit")
PROMPT = [1, 17, 42, 99, 7, 3]


def make_checkpoint(cfg: dict[str, Any], out: Path) -> tuple[Path, int]:
    """A seeded random Llama with labkit-tiny's tokenizer, saved in float32; (folder, params)."""
    import torch

    from labkit.model.llama import LlamaForCausalLM
    from labkit.model.loader import resolve_model_path
    from labkit.train.export import export_hf
    from labkit.train.presets import _llama

    config = _llama(4096, cfg["hidden"], cfg["intermediate"], cfg["layers"], cfg["heads"],
                    cfg["kv_heads"], 1024)
    torch.manual_seed(cfg["seed"])
    model = LlamaForCausalLM(config)
    export_hf(model, config, resolve_model_path("labkit-tiny"), out, dtype=torch.float32)
    shard(out, cfg["shard_mb"] << 20)
    return out, sum(p.numel() for p in model.parameters())


def shard(folder: Path, max_bytes: int) -> None:
    """Split model.safetensors into shards of at most ``max_bytes`` with an index, as Hugging
    Face checkpoints ship (and as an object store serves best: moto's server, like many, reads
    a whole object per ranged GET, so parts of one huge object would each cost the object)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(folder / "model.safetensors"))
    groups: list[dict] = [{}]
    size = 0
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if groups[-1] and size + n > max_bytes:
            groups.append({})
            size = 0
        groups[-1][name] = t
        size += n
    weight_map = {}
    for i, g in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(g, str(folder / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(g, fname))
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def worker(mode: str, uri: str, endpoint: str, cache: str, cfg: dict[str, Any],
           launched: float) -> dict[str, Any]:
    """Runs in the fresh process: load one way, generate, report each phase's end since launch
    (``import_s``: Python, torch, labkit and boto3 imported)."""
    import boto3  # noqa: F401  (imported here so its cost counts as imports, not weights)

    from labkit import LLM
    from labkit.bench.common import greedy_params
    from labkit.model.loader import load_pretrained
    from labkit.model.objstore import S3Source, fetch_checkpoint
    from labkit.model.objstore_stream import load_streaming
    t_import = time.time() - launched
    src = S3Source(uri, endpoint_url=endpoint, cache_dir=Path(cache),
                   part_size=cfg["part_mib"] << 20, max_connections=cfg["connections"])
    t0 = time.time()
    if mode == "stream":
        model, tok = load_streaming(src)
        t_fetch = t_load = time.time() - launched
    else:
        folder = fetch_checkpoint(src, "sequential" if mode == "sequential" else "ranged")
        t_fetch = time.time() - launched
        model, tok = load_pretrained(folder)
        t_load = time.time() - launched
    llm = LLM((model, tok))
    first = llm.generate(prompt_token_ids=[PROMPT], sampling_params=greedy_params(1),
                         use_tqdm=False)
    t_first = time.time() - launched
    out = llm.generate(prompt_token_ids=[PROMPT], sampling_params=greedy_params(cfg["tokens"]),
                       use_tqdm=False)
    return {"mode": mode, "import_s": t_import, "weights_s": t_fetch, "loaded_s": t_load,
            "first_token_s": t_first, "weights_only_s": t_fetch - (t0 - launched),
            "first_token": first[0].outputs[0].token_ids[0],
            "tokens": list(out[0].outputs[0].token_ids)}


def _spawn(mode: str, uri: str, endpoint: str, cache: Path, cfg: dict[str, Any]) -> dict:
    arg = json.dumps({"mode": mode, "uri": uri, "endpoint": endpoint, "cache": str(cache),
                      "cfg": cfg, "launched": time.time()})
    res = subprocess.run([sys.executable, "-m", "labkit.bench.ops_coldstart", "--worker", arg],
                         capture_output=True, text=True, timeout=600)
    if res.returncode != 0:
        raise RuntimeError(f"cold-start worker {mode} failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _local_tokens(folder: Path, n: int) -> list[int]:
    from labkit import LLM
    from labkit.bench.common import greedy_params

    out = LLM(str(folder)).generate(prompt_token_ids=[PROMPT], sampling_params=greedy_params(n),
                                    use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def _bare_torch_s() -> float:
    """A fresh process that only imports torch: the floor under every cold start here."""
    t = time.time()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.time() - t


def run(quick: bool = True, sizes: dict[str, Any] | None = None) -> dict[str, Any]:
    from labkit.bench.s3_loopback import S3Loopback

    cfg = {**(QUICK if quick else FULL), **(sizes or {})}
    with tempfile.TemporaryDirectory() as tmp, \
            S3Loopback(cfg["per_conn_mbps"], cfg["total_mbps"]) as s3:
        folder, params = make_checkpoint(cfg, Path(tmp) / "model")
        nbytes = sum(f.stat().st_size for f in folder.iterdir())
        uri = s3.upload_folder(folder, "labkit-models", "random-llama")
        ref = _local_tokens(folder, cfg["tokens"])
        rows = []
        for mode in tqdm(MODES, desc="cold-start"):
            cache = Path(tmp) / ("cache" if mode == "cache-hit" else f"cache-{mode}")
            rows.append(_spawn(mode, uri, s3.endpoint_url, cache, cfg))
            if mode == "ranged":  # fills the cache the cache-hit start then finds
                cache.rename(Path(tmp) / "cache")
        bare = _bare_torch_s()
    for r in rows:
        r["outputs_match"] = r.pop("tokens") == ref
    by = {r["mode"]: r for r in rows}
    return {"benchmark": "ops cold-start", "quick": quick, "config": cfg, "params": params,
            "checkpoint_bytes": nbytes, "rows": rows, "bare_import_torch_s": bare,
            "outputs_match": all(r["outputs_match"] for r in rows),
            "ranged_over_sequential": by["ranged"]["first_token_s"]
            / by["sequential"]["first_token_s"],
            "stream_over_sequential": by["stream"]["first_token_s"]
            / by["sequential"]["first_token_s"],
            "cache_hit_over_sequential": by["cache-hit"]["first_token_s"]
            / by["sequential"]["first_token_s"],
            "environment": environment()}


def write_chart(payload: dict[str, Any], path: Any) -> None:
    import plotly.graph_objects as go

    rows = payload["rows"]
    modes = [r["mode"] for r in rows]
    fig = go.Figure()
    prev = [0.0] * len(rows)
    for key, label in (("import_s", "imports"), ("weights_s", "weights fetched"),
                       ("loaded_s", "model loaded"), ("first_token_s", "first token")):
        ends = [r[key] for r in rows]
        fig.add_bar(y=modes, x=[e - p for e, p in zip(ends, prev)], name=label,
                    orientation="h")
        prev = ends
    c = payload["config"]
    fig.update_layout(barmode="stack", xaxis_title="seconds since the process started",
                      title=f"Cold start of a {payload['params'] / 1e6:.0f} M-parameter model "
                      f"from S3 ({c['per_conn_mbps']:g} Mb/s per connection, "
                      f"{c['total_mbps']:g} Mb/s per node)")
    fig.write_html(str(path), include_plotlyjs="directory")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"]:
        a = json.loads(argv[1])
        print(json.dumps(worker(a["mode"], a["uri"], a["endpoint"], a["cache"], a["cfg"],
                                a["launched"])))
        return 0
    p = bench_parser("ops cold-start", __doc__.splitlines()[0])
    args = p.parse_args(argv)
    payload = run(quick=args.quick)
    print_table(payload["rows"], ["mode", "import_s", "weights_s", "loaded_s", "first_token_s",
                                  "outputs_match"])
    print(f"{payload['params'] / 1e6:.1f} M parameters, {payload['checkpoint_bytes'] / 1e6:.0f} "
          f"MB; bare `import torch`: {payload['bare_import_torch_s']:.2f} s; first token vs "
          f"sequential: ranged {payload['ranged_over_sequential']:.2f}x, stream "
          f"{payload['stream_over_sequential']:.2f}x, cache hit "
          f"{payload['cache_hit_over_sequential']:.2f}x")
    write_results(args.json, payload, write_chart)
    return 0


if __name__ == "__main__":
    sys.exit(main())

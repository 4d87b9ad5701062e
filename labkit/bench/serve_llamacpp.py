"""``labkit bench serve-llamacpp``: ``labkit serve`` beside llama-cpp-python's OpenAI server.

Both load the same GGUF file (labkit-tiny exported by :func:`labkit.export_gguf`, f32 by
default), both listen on 127.0.0.1, both get the same bounded load from the same client
(:mod:`labkit.bench.serve_client`: streaming ``/v1/completions``, timed from outside) at
concurrency 1 and 8, with the same thread count (``--threads``; ``OMP_NUM_THREADS`` and
llama.cpp's ``n_threads``/``n_threads_batch``). Reported per concurrency: output tokens/s, TTFT
and TPOT of each, and labkit / llama.cpp ratios; then both servers are stopped.

Every request generates exactly ``max_tokens`` tokens on both sides (labkit: ``ignore_eos``;
llama.cpp has no such field, so EOS gets a -100 logit bias) so the work is equal. A separate
check sends a few greedy requests without that and compares the texts the two servers return
(same file, same float32 weights, same prompt token ids: they match; a mismatch is reported,
not hidden). llama-cpp-python's server penalises repetition by default (``repeat_penalty``
1.1, even at temperature 0), so every llama.cpp request sets it to 1.0: otherwise its "greedy"
text differs from greedy decoding wherever the model repeats itself.

Reading the client-side numbers: llama-cpp-python hands every token from a worker thread to
the event loop and an SSE channel (Python per token), so its TPOT at concurrency 1 includes that
hop; at concurrency 8 its requests run one at a time and their tokens can reach the client in
bursts, so its TPOT there is not its decode speed -- compare throughput and TTFT there.
Streamed llama.cpp chunks carry no prompt token count (``total_input_tokens`` 0).

What to expect, and why: at concurrency 1 llama.cpp is faster per token (C++ kernels, no Python
between steps; ``labkit bench gguf`` measures the same for the engines alone). At concurrency 8
llama-cpp-python's server still runs one request at a time (an app-wide lock around its one
``Llama`` object) -- its requests queue, TTFT grows with the queue -- while labkit's scheduler
batches them (continuous batching), so the gap narrows or turns. llama-cpp-python interrupts a
streaming request when another arrives unless started with ``--interrupt_requests False``, which
this benchmark does (otherwise concurrent streams would end early and look fast).

llama.cpp runs in its own interpreter (``find_llamacpp_python``; tests/quant/run_llamacpp.sh
builds it into .venv-llamacpp with the ``[server]`` extra), never in labkit's process. On CPUs
with AMX, quantized files are served with weight repacking off (``--no-repack``: the crash
explained in run_llamacpp.sh); f32/f16 files never take that path.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from labkit.bench.common import bench_parser, environment, print_table, write_json
from labkit.bench.llamacpp import LlamaCppUnavailable, cpu_has_amx, find_llamacpp_python
from labkit.bench.serve import make_requests
from labkit.bench.serve_client import BenchRequest, run_load, summarize

QUICK = {"max_tokens": 32, "requests": {1: 4, 8: 16}, "check_prompts": 3, "check_tokens": 24}
FULL = {"max_tokens": 64, "requests": {1: 8, 8: 32}, "check_prompts": 6, "check_tokens": 48}
MODEL = "labkit-tiny"
# llama-cpp-python's server applies a repetition penalty of 1.1 by default, even at
# temperature 0: greedy then is not greedy. Off, as labkit (and OpenAI's API) have none.
LLAMACPP_PLAIN = {"repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}
# run llama_cpp.server with weight repacking off (llamacpp_worker does the same per process)
NO_REPACK = ("import runpy, llama_cpp.llama_cpp as lc\n"
             "default = lc.llama_model_default_params\n"
             "def no_repack():\n    p = default(); p.use_extra_bufts = False; return p\n"
             "lc.llama_model_default_params = no_repack\n"
             "runpy.run_module('llama_cpp.server', run_name='__main__', alter_sys=True)\n")


def find_llamacpp_server() -> str:
    """The interpreter with ``llama_cpp.server`` importable; raises LlamaCppUnavailable naming
    what is missing."""
    py = find_llamacpp_python()
    if py is None:
        raise LlamaCppUnavailable("llama-cpp-python is not installed; run `bash tests/quant/"
                                  "run_llamacpp.sh --install-only` or set LABKIT_LLAMACPP_PYTHON")
    ok = subprocess.run([py, "-c", "import llama_cpp.server.app"], capture_output=True,
                        timeout=120)
    if ok.returncode != 0:
        raise LlamaCppUnavailable(f"{py} has llama_cpp but not its server extra; install "
                                  "'llama-cpp-python[server]' there (run_llamacpp.sh does)")
    return py


def llamacpp_cmd(python: str, gguf: str, port: int, threads: int, n_ctx: int,
                 no_repack: bool = False) -> list[str]:
    head = [python, "-c", NO_REPACK] if no_repack else [python, "-m", "llama_cpp.server"]
    return [*head, "--model", gguf, "--model_alias", MODEL, "--host", "127.0.0.1",
            "--port", str(port), "--n_threads", str(threads), "--n_threads_batch", str(threads),
            "--n_ctx", str(n_ctx), "--interrupt_requests", "False", "--use_mlock", "False",
            "--verbose", "False"]


def export_file(out_dir: Path, file_type: str) -> tuple[Path, int, int]:
    """labkit-tiny as GGUF in ``out_dir``; returns (path, its context length, EOS id)."""
    from labkit.model.loader import load_pretrained
    from labkit.quant.gguf_export import export_gguf

    model, tok = load_pretrained(MODEL)
    path = out_dir / f"{MODEL}-{file_type}.gguf"
    export_gguf(model, path, type=file_type, tokenizer=tok, progress=False)
    c = model.config
    return path, c.max_position_embeddings, c.eos_token_ids[0]


def greedy_texts(url: str, prompts: list[str], max_tokens: int,
                 extra: dict[str, Any] | None = None) -> list[str]:
    """Plain greedy completions (EOS may stop them), one at a time."""
    import httpx

    out = []
    with httpx.Client(timeout=300) as c:
        for p in prompts:
            r = c.post(url + "/v1/completions", json={"model": MODEL, "prompt": p,
                                                      "max_tokens": max_tokens,
                                                      "temperature": 0.0, **(extra or {})})
            r.raise_for_status()
            out.append(r.json()["choices"][0]["text"])
    return out


def _row(name: str, conc: int, s: dict[str, Any]) -> dict[str, Any]:
    return {"backend": name, "concurrency": conc, "completed": s["completed"],
            "failed": s["failed"], "output_throughput": s["output_throughput"],
            "median_ttft_ms": s["median_ttft_ms"], "p99_ttft_ms": s["p99_ttft_ms"],
            "median_tpot_ms": s["median_tpot_ms"], "total_output_tokens":
            s["total_output_tokens"], "total_input_tokens": s["total_input_tokens"]}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def side_by_side(servers: dict[str, tuple[str, dict]], reqs: list[BenchRequest],
                 cfg: dict[str, Any], bar: Any = None) -> dict[str, Any]:
    """The same load against each server ({name: (url, extra body fields)}), one server at a
    time, at each concurrency; rows plus labkit / llama.cpp ratios per concurrency."""
    rows, ratios = [], {}
    for conc, n in cfg["requests"].items():
        got = {}
        for name, (url, extra) in servers.items():
            res, dur = asyncio.run(run_load(url, MODEL, reqs[:n], max_concurrency=conc,
                                            extra=extra, progress=bar, timeout=600))
            got[name] = summarize(res, dur)
            rows.append(_row(name, conc, got[name]))
        lk, ll = got["labkit"], got["llama.cpp"]
        ratios[str(conc)] = {
            "output_throughput": _ratio(lk["output_throughput"], ll["output_throughput"]),
            "median_ttft": _ratio(lk["median_ttft_ms"], ll["median_ttft_ms"]),
            "median_tpot": _ratio(lk["median_tpot_ms"], ll["median_tpot_ms"])}
    return {"rows": rows, "labkit_over_llamacpp": ratios}


def run(file_type: str = "f32", threads: int = 1, quick: bool = True,
        out_dir: str | Path | None = None) -> dict[str, Any]:
    """Start both servers on one GGUF file, drive the load, stop both; the payload."""
    from labkit.serve.launcher import free_port
    from labkit.serve.process import ServerProcess

    cfg = dict(QUICK if quick else FULL)
    py = find_llamacpp_server()
    tmp = None if out_dir else tempfile.TemporaryDirectory(prefix="labkit-llamacpp-")
    d = Path(out_dir or tmp.name)
    try:
        gguf, n_ctx, eos = export_file(d, file_type)
        no_repack = file_type not in ("f32", "f16") and cpu_has_amx()
        port = free_port()
        ll = ServerProcess(port=port, threads=threads, health="/v1/models", cmd=llamacpp_cmd(
            py, str(gguf), port, threads, n_ctx, no_repack))
        lk = ServerProcess(str(gguf), ["--dtype", "float32", "--max-num-seqs", "16",
                                       "--num-blocks", "512", "--served-model-name", MODEL],
                           threads=threads)
        reqs = make_requests(max(cfg["requests"].values()), cfg["max_tokens"])
        servers: dict[str, tuple[str, dict]] = {}
        total = sum(cfg["requests"].values()) * 2
        bar = tqdm(total=total, desc="serve vs llama.cpp", unit="req")
        with ll, lk:
            plain = {"labkit": {}, "llama.cpp": LLAMACPP_PLAIN}
            servers = {"labkit": (lk.url, {"ignore_eos": True}),
                       "llama.cpp": (ll.url, {**LLAMACPP_PLAIN,
                                              "logit_bias": {str(eos): -100.0}})}
            for url, extra in servers.values():  # warm-up
                asyncio.run(run_load(url, MODEL, reqs[:2], extra=extra))
            prompts = [r.prompt for r in reqs[:cfg["check_prompts"]]]
            texts = {n: greedy_texts(u, prompts, cfg["check_tokens"], plain[n])
                     for n, (u, _) in servers.items()}
            result = side_by_side(servers, reqs, cfg, bar)
        bar.close()
        stopped = {"labkit": lk.proc.poll() is not None, "llama.cpp": ll.proc.poll() is not None}
    finally:
        if tmp is not None:
            tmp.cleanup()
    same = sum(a == b for a, b in zip(texts["labkit"], texts["llama.cpp"]))
    return {"gguf_type": file_type, "threads": threads, "no_repack": no_repack,
            **result, "greedy_same_text": same, "greedy_checked": len(prompts),
            "greedy_texts": texts, "stopped": stopped,
            "config": {k: ({str(c): n for c, n in v.items()} if isinstance(v, dict) else v)
                       for k, v in cfg.items()},
            "load_average": os.getloadavg(),  # other work on the machine skews both sides
            "environment": environment()}


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("serve-llamacpp", __doc__.splitlines()[0])
    p.add_argument("--type", default="f32", choices=["f32", "f16", "q8_0", "q4_0", "q4_k_m"],
                   help="GGUF file type both servers load")
    p.add_argument("--threads", type=int, default=1, help="threads for each server")
    args = p.parse_args(argv)
    try:
        payload = run(args.type, args.threads, args.quick)
    except LlamaCppUnavailable as e:
        print(f"labkit bench serve-llamacpp: {e}")
        return 2
    print_table(payload["rows"])
    for conc, r in payload["labkit_over_llamacpp"].items():
        print(f"concurrency {conc}: labkit / llama.cpp output tok/s "
              f"{r['output_throughput']:.2f}x, median TTFT {r['median_ttft']:.2f}x, "
              f"median TPOT {r['median_tpot']:.2f}x")
    print(f"greedy texts equal on {payload['greedy_same_text']}/{payload['greedy_checked']} "
          "prompts")
    write_json(args.json, payload)
    return 0

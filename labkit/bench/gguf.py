"""``labkit bench gguf``: labkit beside llama.cpp on the same model, and a load-time lab.

Side by side in one run, threads pinned equal (torch.set_num_threads and llama.cpp's n_threads
both = --threads, OMP_NUM_THREADS likewise), batch 1, greedy, the same prompt ids:

* decode tokens/s and time to first token (prefill of the prompt + one token) for labkit
  (float32 weights from safetensors, and from a Q4_K_M GGUF dequantized at load) and llama.cpp
  on labkit's GGUF exports (f32, f16, q8_0, q4_k_m). llama.cpp runs in its own process
  (labkit.bench.llamacpp): torch and llama_cpp in one interpreter crashed in an earlier trial.
* load-time lab: bytes of the safetensors and the GGUF file brought into memory by mmap (every
  page touched) vs read(), with the file's page cache dropped first (posix_fadvise DONTNEED:
  "cold") or not ("warm"); then the whole "model ready" time for labkit (safetensors folder vs
  .gguf) and llama.cpp (use_mmap on/off), and time to first token from process start.

Ratios are printed as labkit / llama.cpp. The serving comparison (``labkit bench serve`` against
llama-cpp-python's OpenAI server) is not part of this benchmark.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from labkit.bench.common import bench_parser, environment, print_table, write_json
from labkit.bench.llamacpp import (
    LlamaCppCrashed,
    LlamaCppUnavailable,
    cpu_has_amx,
    find_llamacpp_python,
    run_llamacpp,
)

QUICK = {"prompt_len": 64, "new_tokens": 32, "repeats": 2, "load_repeats": 2,
         "types": ["f32", "q8_0", "q4_k_m"]}
FULL = {"prompt_len": 128, "new_tokens": 128, "repeats": 3, "load_repeats": 5,
        "types": ["f32", "f16", "q8_0", "q4_0", "q4_k_m"]}
PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"


def prompt_ids(tokenizer, n: int) -> list[int]:
    """Exactly n ids: the prompt text repeated (labkit's ids, BOS first, given to both)."""
    ids = tokenizer.encode(PROMPT * (n // 8 + 1))
    return ids[:n]


def labkit_speed(model, prompt: list[int], new_tokens: int, repeats: int) -> dict[str, float]:
    from labkit.model.generate import stream_generate

    ttft, tps = [], []
    with torch.no_grad():
        for _ in range(repeats):
            t0 = time.perf_counter()
            stream = stream_generate(model, prompt, new_tokens + 1, ignore_eos=True)
            next(stream)
            t1 = time.perf_counter()
            n = sum(1 for _ in stream)
            tps.append(n / (time.perf_counter() - t1))
            ttft.append(t1 - t0)
    return {"ttft_ms": 1e3 * float(np.median(ttft)), "decode_tok_s": float(np.median(tps))}


def drop_page_cache(path: str | Path) -> bool:
    """Ask the kernel to forget the file's cached pages; False where that is not allowed."""
    if not hasattr(os, "posix_fadvise"):
        return False
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        return True
    except OSError:
        return False


def bytes_in(path: str | Path, mode: str) -> float:
    """Seconds to bring every byte of ``path`` into memory by 'mmap' (touch each page) or 'read'."""
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        if mode == "read":
            data = f.read()
            assert len(data) > 0
        else:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
                view = np.frombuffer(m, dtype=np.uint8)
                int(view[:: mmap.PAGESIZE].sum())  # one byte per page faults every page in
                del view
    return time.perf_counter() - t0


def _timed(fn, path, cold: bool, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        if cold:
            drop_page_cache(path)
        times.append(fn())
    return 1e3 * float(np.median(times))


def load_lab(st_file: Path, gguf_file: Path, folder: Path, repeats: int) -> list[dict]:
    from labkit.model.loader import load_pretrained

    rows = []
    for fmt, f in (("safetensors", st_file), ("gguf f32", gguf_file)):
        for cache in ("cold", "warm"):
            for mode in ("mmap", "read"):
                ms = _timed(lambda f=f, mode=mode: bytes_in(f, mode), f, cache == "cold", repeats)
                rows.append({"what": f"bytes in ({mode})", "file": fmt, "cache": cache,
                             "ms": ms, "MB": f.stat().st_size / 1e6})

    def ready(src):
        t0 = time.perf_counter()
        load_pretrained(src)
        return time.perf_counter() - t0

    for fmt, src, f in (("safetensors", folder, st_file), ("gguf f32", gguf_file, gguf_file)):
        for cache in ("cold", "warm"):
            rows.append({"what": "labkit model ready", "file": fmt, "cache": cache,
                         "ms": _timed(lambda src=src: ready(src), f, cache == "cold", repeats),
                         "MB": f.stat().st_size / 1e6})
    return rows


def process_ttft(folder: Path, gguf_file: Path, prompt: list[int], threads: int,
                 llamacpp: str | None) -> list[dict]:
    """Wall time from spawning a fresh interpreter to the first generated token."""
    script = (f"import sys, torch; torch.set_num_threads({threads}); import labkit; "
              "m, _ = labkit.load_pretrained(sys.argv[1]); "
              f"labkit.generate(m, {prompt!r}, 1, ignore_eos=True)")
    rows = []
    for fmt, src in (("safetensors", folder), ("gguf f32", gguf_file)):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", script, str(src)], check=True,
                       env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        rows.append({"engine": "labkit", "file": fmt, "ms": 1e3 * (time.perf_counter() - t0)})
    if llamacpp:
        t0 = time.perf_counter()
        run_llamacpp({"model": str(gguf_file), "threads": threads, "n_ctx": 512,
                      "extra_bufts": not cpu_has_amx(),
                      "tasks": [{"kind": "greedy", "prompts": [prompt], "max_tokens": 1}]},
                     llamacpp)
        rows.append({"engine": "llama.cpp", "file": "gguf f32",
                     "ms": 1e3 * (time.perf_counter() - t0)})
    return rows


def llamacpp_rows(files: dict[str, Path], prompt, cfg, threads, python) -> list[dict]:
    rows = []
    for t, f in tqdm(files.items(), desc="llama.cpp"):
        req = {"model": str(f), "threads": threads, "n_ctx": 512,
               "extra_bufts": not cpu_has_amx(),
               "tasks": [{"kind": "speed", "prompt": prompt, "new_tokens": cfg["new_tokens"],
                          "repeats": cfg["repeats"]}]}
        try:
            s = run_llamacpp(req, python)["results"][0]
        except LlamaCppCrashed as e:
            rows.append({"engine": "llama.cpp", "format": f"{t} gguf", "error": e.signal})
            continue
        rows.append({"engine": "llama.cpp", "format": f"{t} gguf",
                     "ttft_ms": 1e3 * float(np.median(s["ttft_s"])),
                     "decode_tok_s": float(np.median(s["decode_tok_s"]))})
    return rows


def llamacpp_load_rows(f: Path, repeats: int, python: str) -> list[dict]:
    """llama.cpp's own model load (Llama() construction) with use_mmap on/off, cold/warm."""
    rows = []
    for cache in ("cold", "warm"):
        for use_mmap in (True, False):
            req = {"model": str(f), "use_mmap": use_mmap, "extra_bufts": not cpu_has_amx(),
                   "tasks": [{"kind": "load"}]}
            ms = _timed(lambda req=req: run_llamacpp(req, python)["load_s"], f,
                        cache == "cold", repeats)
            rows.append({"what": f"llama.cpp model ready ({'mmap' if use_mmap else 'read'})",
                         "file": "gguf f32", "cache": cache, "ms": ms,
                         "MB": f.stat().st_size / 1e6})
    return rows


def run(cfg: dict[str, Any], threads: int, workdir: Path) -> dict[str, Any]:
    from labkit.model.loader import load_pretrained, resolve_model_path
    from labkit.quant.gguf_export import export_gguf

    torch.set_num_threads(threads)
    folder = resolve_model_path("labkit-tiny")
    model, tok = load_pretrained(folder)
    files = {t: workdir / f"labkit-tiny-{t}.gguf" for t in cfg["types"]}
    for t, f in tqdm(files.items(), desc="export gguf"):
        export_gguf(model, f, type=t, tokenizer=tok, progress=False)
    prompt = prompt_ids(tok, cfg["prompt_len"])
    speed = [{"engine": "labkit", "format": "fp32 (safetensors)",
              **labkit_speed(model, prompt, cfg["new_tokens"], cfg["repeats"])}]
    q_model, _ = load_pretrained(files["q4_k_m"])
    speed.append({"engine": "labkit", "format": "q4_k_m gguf, dequantized to fp32",
                  **labkit_speed(q_model, prompt, cfg["new_tokens"], cfg["repeats"])})
    python = find_llamacpp_python()
    note = None
    if python is None:
        note = str(LlamaCppUnavailable("llama.cpp rows skipped: llama-cpp-python not installed"))
    else:
        speed += llamacpp_rows(files, prompt, cfg, threads, python)
    ratios = {}
    base = speed[0]
    for r in speed[2:]:
        if "decode_tok_s" in r:
            ratios[f"llama.cpp {r['format']} / labkit fp32 decode"] = \
                r["decode_tok_s"] / base["decode_tok_s"]
            ratios[f"labkit fp32 / llama.cpp {r['format']} ttft"] = base["ttft_ms"] / r["ttft_ms"]
    load = load_lab(folder / "model.safetensors", files["f32"], folder, cfg["load_repeats"])
    if python:
        load += llamacpp_load_rows(files["f32"], cfg["load_repeats"], python)
    start = process_ttft(folder, files["f32"], prompt, threads, python)
    return {"config": {**cfg, "threads": threads, "prompt_tokens": len(prompt),
                       "llama_cpp_no_repack": cpu_has_amx(), "page_cache_drop":
                       drop_page_cache(files["f32"])},
            "speed": speed, "ratios": ratios, "load": load, "process_ttft": start,
            "note": note, "environment": {**environment(), "loadavg_1m_at_end":
                                          os.getloadavg()[0], "cpus": os.cpu_count()}}


def write_chart(payload: dict[str, Any], path: Path) -> None:
    from plotly.subplots import make_subplots

    speed = [r for r in payload["speed"] if "decode_tok_s" in r]
    names = [f"{r['engine']}<br>{r['format']}" for r in speed]
    fig = make_subplots(rows=1, cols=3, subplot_titles=(
        "decode tokens/s (batch 1)", "time to first token (ms)", "load (ms)"))
    fig.add_bar(x=names, y=[r["decode_tok_s"] for r in speed], row=1, col=1, showlegend=False)
    fig.add_bar(x=names, y=[r["ttft_ms"] for r in speed], row=1, col=2, showlegend=False)
    for cache in ("cold", "warm"):
        rows = [r for r in payload["load"] if r["cache"] == cache]
        fig.add_bar(x=[f"{r['what']}<br>{r['file']}" for r in rows], y=[r["ms"] for r in rows],
                    name=cache, row=1, col=3)
    fig.update_layout(title=f"labkit vs llama.cpp, labkit-tiny, {payload['config']['threads']} "
                      "threads", height=520, width=1500)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.write_html(str(path), include_plotlyjs="directory")


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("gguf", __doc__.splitlines()[0])
    p.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    args = p.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    with tempfile.TemporaryDirectory(prefix="labkit-gguf-") as d:
        payload = run(cfg, args.threads, Path(d))
    print_table(payload["speed"])
    print()
    print_table(payload["load"])
    print()
    print_table(payload["process_ttft"])
    for k, v in payload["ratios"].items():
        print(f"{k}: {v:.2f}x")
    if payload["note"]:
        print(payload["note"])
    write_json(args.json, payload)
    if args.json:
        try:
            write_chart(payload, Path(args.json).with_suffix(".html"))
        except ImportError:
            print("plotly is not installed (pip install labkit[lab]); chart skipped")
    return 0


if __name__ == "__main__":
    sys.exit(main())

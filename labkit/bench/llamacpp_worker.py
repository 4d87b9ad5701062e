"""llama.cpp's side of the GGUF comparisons, run as its own process: ``python llamacpp_worker.py``.

Reads one JSON request on stdin, writes one JSON reply on stdout. It imports only the standard
library, numpy and ``llama_cpp`` (llama-cpp-python), never torch or labkit: importing torch and
llama_cpp into one process crashed in an earlier trial (two OpenMP runtimes and two sets of
CPU kernels in one address space), and a separate interpreter also lets llama.cpp live in its own
virtual environment. Callers: tests/quant/test_gguf_llamacpp.py and ``labkit bench gguf``.

Request: {"model": path, "threads": int, "n_ctx": int, "extra_bufts": bool, "tasks": [...]}
Tasks (each answered in order, under "results"):
  {"kind": "greedy", "prompts": [[ids]], "max_tokens": n}  -> {"tokens": [[ids]]}
  {"kind": "nll", "windows": [[ids]]}                      -> {"nll": sum, "count": n}
  {"kind": "speed", "prompt": [ids], "new_tokens": n, "repeats": r}
                                                -> {"ttft_s": [..], "decode_tok_s": [..]}
  {"kind": "quantize", "src": path, "dst": path, "ftype": int}  -> {"rc": int}
"extra_bufts": false is llama.cpp's --no-repack: weights stay in plain CPU buffers instead of
being repacked for AMX / AVX-512 kernels (see tests/quant/run_llamacpp.sh for why it matters).
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

import numpy as np


def _load(req: dict):
    import llama_cpp
    import llama_cpp.llama_cpp as lc

    if not req.get("extra_bufts", True):
        default = lc.llama_model_default_params

        def no_repack():
            p = default()
            p.use_extra_bufts = False
            return p

        lc.llama_model_default_params = no_repack
    t0 = time.perf_counter()
    llm = llama_cpp.Llama(model_path=req["model"], n_ctx=req.get("n_ctx", 512),
                          n_batch=req.get("n_ctx", 512), n_threads=req.get("threads", 1),
                          n_threads_batch=req.get("threads", 1), logits_all=req.get("logits_all",
                                                                                    False),
                          use_mmap=req.get("use_mmap", True), verbose=False, seed=0)
    return llm, time.perf_counter() - t0


def _last_logits(llm) -> np.ndarray:
    return np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))


def greedy(llm, prompts: list[list[int]], max_tokens: int) -> dict:
    out = []
    for prompt in prompts:
        llm.reset()
        llm.eval(prompt)
        toks = []
        for _ in range(max_tokens):
            t = int(np.argmax(_last_logits(llm)))
            toks.append(t)
            llm.eval([t])
        out.append(toks)
    return {"tokens": out}


def nll(llm, windows: list[list[int]]) -> dict:
    total, count = 0.0, 0
    for w in windows:
        llm.reset()
        llm.eval(w)
        logits = np.asarray(llm.scores[: len(w) - 1], dtype=np.float64)
        logits -= logits.max(-1, keepdims=True)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        total -= float(logp[np.arange(len(w) - 1), w[1:]].sum())
        count += len(w) - 1
    return {"nll": total, "count": count}


def speed(llm, prompt: list[int], new_tokens: int, repeats: int) -> dict:
    ttft, tps = [], []
    for _ in range(repeats):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        t = int(np.argmax(_last_logits(llm)))
        t1 = time.perf_counter()
        for _ in range(new_tokens):
            llm.eval([t])
            t = int(np.argmax(_last_logits(llm)))
        ttft.append(t1 - t0)
        tps.append(new_tokens / (time.perf_counter() - t1))
    return {"ttft_s": ttft, "decode_tok_s": tps}


def quantize(src: str, dst: str, ftype: int) -> dict:
    import llama_cpp.llama_cpp as lc

    params = lc.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 1
    return {"rc": int(lc.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params)))}


def main() -> int:
    req = json.loads(sys.stdin.read())
    results, load_s = [], None
    llm = None
    for task in req["tasks"]:
        kind = task["kind"]
        if kind == "quantize":
            results.append(quantize(task["src"], task["dst"], task["ftype"]))
            continue
        if llm is None:
            llm, load_s = _load(req)
        if kind == "greedy":
            results.append(greedy(llm, task["prompts"], task["max_tokens"]))
        elif kind == "nll":
            results.append(nll(llm, task["windows"]))
        elif kind == "speed":
            results.append(speed(llm, task["prompt"], task["new_tokens"], task["repeats"]))
        elif kind == "load":
            results.append({"load_s": load_s})
        else:
            raise SystemExit(f"unknown task kind {kind!r}")
    json.dump({"results": results, "load_s": load_s}, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU check for tensor parallelism (not collected by pytest; run by .ci/gpu on a lent GPU).

    python tests/parallel/gpu_check.py [--device cuda] [--out tp_gpu_check.json]

The engine's worker-process path on the device: ``LLM(..., distributed_executor_backend="mp")``
starts one worker per GPU (world size 1 on a one-GPU machine), joined by NCCL (gloo with
``--device cpu``), and the collectives inside every forward really run through it. Checks:
the rank reports the expected backend and device; greedy output equals the reference decoder on
the same device token for token (with prefix hits and chunked prefill in the run); every step's
all-reduce count and bytes equal 2·layers+1 of tokens·hidden·4. With 2 or more GPUs, the same
at tensor_parallel_size=2. Multi-GPU speed is not measured here: it is simulated
(labkit.sim.parallel).
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch


def check(device: str, tp: int, prompts: list[list[int]], new: int) -> dict:
    from labkit.engine.llm import LLM
    from labkit.engine.sampling_params import SamplingParams
    from labkit.model.generate import generate
    from labkit.model.loader import load_pretrained

    model, _ = load_pretrained("labkit-tiny", device=device)
    t0 = time.perf_counter()
    llm = LLM("labkit-tiny", device=device, tensor_parallel_size=tp,
              distributed_executor_backend="mp", block_size=8, max_num_batched_tokens=32)
    try:
        started = time.perf_counter() - t0
        ranks = llm.llm_engine.executor.runner.workers.call("describe")
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
            temperature=0, max_tokens=new, ignore_eos=True))
        match = [o.outputs[0].token_ids == generate(model, p, new, ignore_eos=True)
                 for p, o in zip(prompts, outs)]
        L, h = model.config.num_hidden_layers, model.config.hidden_size
        formula = all(s["collectives"]["all_reduce"] == {
            "count": 2 * L + 1, "bytes": (2 * L + 1) * s["num_batched_tokens"] * h * 4}
            for s in llm.llm_engine.trace.steps if s["scheduled"])
        stats = llm.llm_engine.stats()
    finally:
        llm.shutdown()
    want = "nccl" if device == "cuda" else "gloo"
    ok = (all(r["backend"] == want and r["device"].startswith(device) for r in ranks)
          and all(match) and formula)
    return {"ok": ok, "ranks": ranks, "match": match, "collectives_match_formula": formula,
            "prefix_hit_tokens": stats["prefix_hit_tokens"], "start_s": round(started, 1)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="tp_gpu_check.json")
    a = ap.parse_args()
    res: dict = {"device": a.device, "torch": torch.__version__}
    if a.device == "cuda":
        res["gpu"] = torch.cuda.get_device_name()
        v = torch.cuda.nccl.version()  # a tuple in recent torch, an int in older ones
        res["nccl"] = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 4096, (40,), generator=g).tolist()
    prompts = [shared + [5, 6], torch.randint(3, 4096, (9,), generator=g).tolist(), shared + [7]]
    gpus = torch.cuda.device_count() if a.device == "cuda" else 2
    for tp in (1, 2):
        if tp > gpus:
            res[f"tp{tp}"] = {"skipped": f"needs {tp} GPUs, this machine has {gpus}"}
            continue
        try:
            res[f"tp{tp}"] = check(a.device, tp, prompts, 12)
        except Exception:  # noqa: BLE001 - report and continue
            res[f"tp{tp}"] = {"ok": False, "error": traceback.format_exc()[-3000:]}
        print(f"tp{tp}", res[f"tp{tp}"], flush=True)
    res["multi_gpu_speed"] = "simulated (labkit.sim.parallel), not measured"
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    ok = all(v.get("ok", True) for k, v in res.items() if k.startswith("tp"))
    print(f"tensor-parallel GPU check: {'passed' if ok else 'FAILED'} -> {a.out}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

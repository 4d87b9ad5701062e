"""GPU check for the engine (not collected by pytest; run by a session with a lent GPU).

    python tests/engine/gpu_check.py [--device cuda] [--out gpu_engine.json]

1. Greedy engine output == reference generate on the device, for the torch and triton attention
   backends, block sizes 16 and 5, prefix caching on, a shared prefix, n=2 seeded sampling.
2. Throughput of LLM.generate (64 prompts x 128 new tokens) per backend on labkit-tiny.
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", default="gpu_engine.json")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    from labkit.engine.llm import LLM
    from labkit.engine.sampling_params import SamplingParams
    from labkit.model.generate import generate
    from labkit.model.loader import load_pretrained

    res: dict = {"device": a.device, "torch": torch.__version__}
    if a.device == "cuda":
        res["gpu"] = torch.cuda.get_device_name()
    model, tok = load_pretrained("labkit-tiny", device=a.device)
    g = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 4096, (40,), generator=g).tolist()
    prompts = [torch.randint(3, 4096, (int(n),), generator=g).tolist() for n in (1, 7, 16, 33)]
    prompts += [shared + [5, 6], shared + [7], shared + [5, 6]]
    new = 8 if a.quick else 24
    backends = ["torch", "triton"]
    for be in backends:
        for bs in (16, 5):
            key = f"greedy_{be}_bs{bs}"
            try:
                llm = LLM.from_model(model, tok, block_size=bs, attention_backend=be,
                                     max_num_seqs=3, max_num_batched_tokens=32)
                outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
                    temperature=0, max_tokens=new, ignore_eos=True))
                ok = [o.outputs[0].token_ids == generate(model, p, new, ignore_eos=True)
                      for p, o in zip(prompts, outs)]
                sp = SamplingParams(n=2, temperature=0.8, top_p=0.9, seed=7, max_tokens=new,
                                    ignore_eos=True)
                o = llm.generate(prompt_token_ids=[prompts[3]], sampling_params=sp)[0]
                ok += [c.token_ids == generate(model, prompts[3], new, temperature=0.8,
                                               top_p=0.9, seed=7 + i, ignore_eos=True)
                       for i, c in enumerate(o.outputs)]
                res[key] = {"match": ok, "hit_tokens": llm.llm_engine.stats()["prefix_hit_tokens"]}
            except Exception:  # noqa: BLE001 - report and continue with the next check
                res[key] = {"error": traceback.format_exc()[-2000:]}
            print(key, res[key], flush=True)
    n_req, n_new = (16, 32) if a.quick else (64, 128)
    bench_prompts = [torch.randint(3, 4096, (64,), generator=g).tolist() for _ in range(n_req)]
    for be in backends:
        try:
            llm = LLM.from_model(model, tok, block_size=16, attention_backend=be,
                                 max_num_seqs=64, max_num_batched_tokens=2048)
            sp = SamplingParams(temperature=0, max_tokens=n_new, ignore_eos=True, detokenize=False)
            llm.generate(prompt_token_ids=bench_prompts[:4], sampling_params=sp)  # warm-up
            if a.device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            llm.generate(prompt_token_ids=bench_prompts, sampling_params=sp)
            if a.device == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t
            steps = llm.llm_engine.num_steps
            res[f"throughput_{be}"] = {"tokens_per_s": n_req * n_new / dt, "seconds": dt,
                                       "requests": n_req, "new_tokens": n_new, "steps": steps}
        except Exception:  # noqa: BLE001
            res[f"throughput_{be}"] = {"error": traceback.format_exc()[-2000:]}
        print(be, res[f"throughput_{be}"], flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    bad = [k for k, v in res.items() if isinstance(v, dict)
           and ("error" in v or not all(v.get("match", [True])))]
    print("engine GPU check:", "FAILED " + ", ".join(bad) if bad else "all greedy/seeded "
          "outputs equal the reference")
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())

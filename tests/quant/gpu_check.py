"""GPU check for labkit.quant (not collected by pytest; run by a session with a lent GPU).

    python tests/quant/gpu_check.py [--out quant_gpu_check.json]

1. Every quantized linear on CUDA in fp16 (GPTQ / AWQ / W8A16 through the Triton
   ``dequant_matmul`` kernels, NF4 / FP8 through torch) against the float32 CPU product with its
   own dequantized weight, for M = 1, 7, 64 tokens.
2. labkit-tiny quantized on the CPU (RTN / GPTQ / AWQ / INT8), then run on the GPU in fp16:
   held-out perplexity GPU vs CPU, and greedy decode tokens/s on the GPU (batch 1, the
   memory-bound case the 4-bit kernels exist for), fp16 weights side by side.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import sys
import time
import traceback

import torch


def _alias_kernels() -> None:
    """Running from a source tree without `pip install -e .`: kernels/ is labkit.kernels."""
    try:
        importlib.import_module("labkit.kernels.dequant_matmul")
    except ImportError:
        import kernels

        sys.modules["labkit.kernels"] = kernels


def check_layers(res: dict) -> None:
    import torch.nn.functional as F

    from labkit.quant import quantize_fp8, quantize_int8, quantize_nf4, quantize_rtn
    from labkit.quant.gptq import gptq_quantize
    from labkit.quant.linear import AWQLinear, FP8Linear, GPTQLinear, NF4Linear, W8A16Linear

    g = torch.Generator().manual_seed(0)
    rows = []
    for N, K, gs in ((256, 704, 64), (512, 256, 128)):
        w = torch.randn(N, K, generator=g) * 0.05
        X = torch.randn(512, K, generator=g)
        bias = torch.randn(N, generator=g) * 0.1
        layers = {
            "w8a16": W8A16Linear(*quantize_int8(w), bias=bias),
            "gptq": GPTQLinear.from_quant(quantize_rtn(w, 4, gs), bias),
            "gptq_act_order": GPTQLinear.from_quant(
                gptq_quantize(w, 2 * X.double().T @ X.double() / 512, 4, gs,
                              act_order=True).quant, bias),
            "awq": AWQLinear.from_quant(quantize_rtn(w, 4, gs), bias),
            "nf4": NF4Linear(quantize_nf4(w, 64), bias),
            "fp8": FP8Linear(*quantize_fp8(w), bias=bias),
        }
        for name, lin in layers.items():
            for M in (1, 7, 64):
                x = torch.randn(M, K, generator=g)
                ref = F.linear(x, lin.dequantize(), bias)
                out = copy.deepcopy(lin).cuda()(x.half().cuda()).float().cpu()
                rel = float((out - ref).abs().max() / ref.abs().max())
                rows.append({"layer": name, "N": N, "K": K, "M": M, "max_rel_err": rel,
                             "ok": rel < 1e-2})
    res["layers"] = rows
    res["layers_ok"] = all(r["ok"] for r in rows)
    print("layers ok:", res["layers_ok"], flush=True)


def check_model(res: dict) -> None:
    from labkit.model.generate import generate
    from labkit.model.loader import load_pretrained
    from labkit.quant import awq_quantize_model, gptq_quantize_model, quantize_model
    from labkit.quant.calib import corpus_windows
    from labkit.quant.evaluate import log_probs, perplexity_from_logprobs

    model, tok = load_pretrained("labkit-tiny")
    calib = corpus_windows(tok, "train", 32, 256)
    ev = corpus_windows(tok, "heldout", 16, 256)
    kw = {"group_size": 128, "group_fallback": True}
    variants = {
        "fp16": model,
        "int8": quantize_model(model, "int8"),
        "int4_rtn": quantize_model(model, "int4_rtn", **kw),
        "gptq": gptq_quantize_model(model, calib, act_order=True, progress=False, **kw)[0],
        "awq": awq_quantize_model(model, calib, progress=False, **kw)[0],
    }
    prompt = ev[0, :16].tolist()
    rows = []
    for name, m in variants.items():
        cpu_ppl = perplexity_from_logprobs(log_probs(m, ev), ev)
        gm = copy.deepcopy(m).cuda().half()
        gpu_ppl = perplexity_from_logprobs(log_probs(gm, ev.cuda()), ev)
        generate(gm, prompt, 8, ignore_eos=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        generate(gm, prompt, 128, ignore_eos=True)
        torch.cuda.synchronize()
        tps = 128 / (time.perf_counter() - t0)
        rows.append({"format": name, "cpu_fp32_ppl": cpu_ppl, "gpu_fp16_ppl": gpu_ppl,
                     "ppl_rel_diff": abs(gpu_ppl - cpu_ppl) / cpu_ppl,
                     "gpu_decode_tokens_per_s": tps})
        print(rows[-1], flush=True)
    res["model"] = rows
    res["model_ok"] = all(r["ppl_rel_diff"] < 0.01 for r in rows)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="quant_gpu_check.json")
    a = ap.parse_args()
    _alias_kernels()
    res: dict = {"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}
    for step in (check_layers, check_model):
        try:
            step(res)
        except Exception:
            res[f"{step.__name__}_error"] = traceback.format_exc()
            print(res[f"{step.__name__}_error"], flush=True)
        with open(a.out, "w") as f:  # after each step: a time limit keeps what finished
            json.dump(res, f, indent=2)
    print("wrote", a.out)
    errors = [k for k in res if k.endswith("_error")]
    ok = not errors and res.get("model_ok", False) and res.get("layers_ok", False)
    print("quant GPU check:", "ok" if ok else f"FAILED {errors or 'tolerance'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

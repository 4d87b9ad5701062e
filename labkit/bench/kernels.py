"""``labkit bench kernels``: check every Triton kernel at real sizes, then time it on a GPU.

Each number sits beside its ceiling or baseline measured in the same run: the device's copy
bandwidth for memory-bound kernels (paged decode, reshape_and_cache, NF4, norms), PyTorch SDPA on
the same KV gathered into contiguous tensors for attention, fp16 ``F.linear`` for dequant-matmul.
Times are medians from ``triton.testing.do_bench`` (it flushes L2 before every call). Writes
JSON and a markdown table (default ``datasets/results/kernels.json`` / ``.md``).
"""

from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from labkit.bench.common import bench_parser, print_table, write_json
from labkit.bench.kernels_harness import Bench, _gathered, _sdpa
from labkit.bench.kernels_report import targets, to_markdown  # noqa: F401 (targets: tests)
from labkit.bench.kernels_sizes import FULL, QUICK, SMOKE, SWEEP  # noqa: F401 (SMOKE: tests)
from labkit.kernels import selfcheck as sc
from labkit.paths import RESULTS_DIR

DEFAULT_JSON = RESULTS_DIR / "kernels.json"


BF16 = torch.bfloat16


def sec_checks(b: Bench) -> None:
    sc.check_all(b.check, b.sizes, b.device, b.gen)


def sec_odd_shapes(b: Bench) -> None:
    sc.check_odd_shapes(b.check, b.device, b.gen)


def sec_copy(b: Bench) -> None:
    src = torch.empty(b.sizes["copy_bytes"] // 2, dtype=BF16, device=b.device)
    src.normal_(generator=b.gen)
    dst = torch.empty_like(src)
    t = b.measure(torch.Tensor.copy_, dst, src)
    nbytes = 2 * src.numel() * src.element_size()
    b.copy_gbps = nbytes / t["ms"] / 1e6
    b.add("copy (torch, d2d)", f"{src.numel() * 2 >> 20} MiB", t, nbytes=nbytes)


def sec_decode(b: Bench) -> None:
    for nseq, ctx in b.sizes["decode"]:
        _decode_case(b, nseq, ctx)


def _decode_case(b: Bench, nseq: int, ctx: int) -> None:
    from labkit.kernels.paged_attention import default_num_splits, paged_attention_decode

    hq, hkv, d = b.sizes["heads"]
    bs, scale = b.sizes["block_size"], d**-0.5
    q, kc, vc, bt, lens = sc.paged_setup(nseq, ctx, (hq, hkv, d), bs, BF16, b.device, b.gen)
    kg, vg = _gathered(kc, bt, ctx), _gathered(vc, bt, ctx)
    qs = q[:, :, None, :]
    ref = _sdpa(qs, kg, vg, scale=scale)[:, :, 0]
    base = b.measure(partial(_sdpa, scale=scale), qs, kg, vg)
    del kg, vg
    nbytes = 2 * nseq * ctx * hkv * d * 2
    shape = f"B={nseq} ctx={ctx} Hq={hq} Hkv={hkv} D={d} bs={bs}"
    for forced in ((None, 1) if nseq == 1 else (None,)):
        splits = forced or default_num_splits(nseq, hkv, bt.shape[1] * bs)

        def fn(q, kc, vc, f=forced):
            return paged_attention_decode(q, kc, vc, bt, lens, scale, f)

        err = sc.rel_err(fn(q, kc, vc), ref)
        b.add("paged_attention_decode" + (" (no split)" if forced else ""), shape,
              b.measure(fn, q, kc, vc), "SDPA on gathered KV", base, nbytes=nbytes,
              num_splits=splits, rel_err_vs_sdpa=err)


def sec_decode_int8(b: Bench) -> None:
    """The INT8 KV cache's decode at the headline shape, beside the bf16 rows: D + 2 bytes per
    (token, head) for K or V instead of 2D, so ideally ~1.9x less time when memory-bound."""
    from labkit.kernels.paged_attention import paged_attention_decode
    from labkit.kv.ops import quantize_kv_per_head

    hq, hkv, d = b.sizes["heads"]
    bs, scale = b.sizes["block_size"], d**-0.5
    nseq, ctx = b.sizes["tune_decode"]
    q, kc, vc, bt, lens = sc.paged_setup(nseq, ctx, (hq, hkv, d), bs, BF16, b.device, b.gen)
    (kq, ks), (vq, vs) = quantize_kv_per_head(kc), quantize_kv_per_head(vc)
    ref = paged_attention_decode(q, kc, vc, bt, lens, scale)
    del kc, vc

    def fn(q, kq, vq):
        return paged_attention_decode(q, kq, vq, bt, lens, scale, k_scale=ks, v_scale=vs)

    err = sc.rel_err(fn(q, kq, vq), ref)  # int8 rounding vs the bf16 cache it came from
    b.add("paged_attention_decode (int8 KV)", f"B={nseq} ctx={ctx} Hq={hq} Hkv={hkv} D={d} "
          f"bs={bs}", b.measure(fn, q, kq, vq), nbytes=2 * nseq * ctx * hkv * (d + 2),
          rel_err_vs_bf16_cache=err)


def sec_prefill(b: Bench) -> None:
    for nseq, qlen, ctx in b.sizes["prefill"]:
        _prefill_case(b, nseq, qlen, ctx)


def _prefill_case(b: Bench, nseq: int, qlen: int, ctx: int) -> None:
    from labkit.kernels.paged_prefill import paged_prefill_attention

    hq, hkv, d = b.sizes["heads"]
    bs, scale = b.sizes["block_size"], d**-0.5
    q, kc, vc, bt, lens = sc.paged_setup(nseq, ctx, (hq, hkv, d), bs, BF16, b.device, b.gen,
                                       q_tokens=nseq * qlen)
    qsl = torch.arange(nseq + 1, device=b.device, dtype=torch.int32) * qlen
    kg, vg = _gathered(kc, bt, ctx), _gathered(vc, bt, ctx)
    qs = q.view(nseq, qlen, hq, d).transpose(1, 2)
    if qlen == ctx:
        kw: dict[str, Any] = {"is_causal": True}
    else:
        pos = torch.arange(ctx - qlen, ctx, device=b.device)
        kw = {"attn_mask": torch.arange(ctx, device=b.device)[None, :] <= pos[:, None]}
    ref = _sdpa(qs, kg, vg, scale=scale, **kw).transpose(1, 2).reshape(-1, hq, d)
    base = b.measure(partial(_sdpa, scale=scale, **kw), qs, kg, vg)
    del kg, vg

    def fn(q, kc, vc):
        return paged_prefill_attention(q, kc, vc, bt, qsl, lens, scale, qlen)

    err = sc.rel_err(fn(q, kc, vc), ref)
    visible = qlen * (ctx - qlen) + qlen * (qlen + 1) // 2
    b.add("paged_prefill_attention", f"{nseq} seqs q_len={qlen} ctx={ctx} Hq={hq} D={d}",
          b.measure(fn, q, kc, vc), "SDPA contiguous" + (" causal" if qlen == ctx else " +mask"),
          base, flops=4.0 * nseq * hq * d * visible, rel_err_vs_sdpa=err)


def sec_dequant(b: Bench) -> None:
    from labkit.kernels import dequant_matmul as dq

    for m, k in b.sizes["dequant"]:
        _dequant_shape(b, m, k, dq)


def _dequant_shape(b: Bench, m: int, k: int, dq) -> None:
    w16 = torch.randn(k, k, generator=b.gen, device=b.device).half()
    x0 = torch.randn(m, k, generator=b.gen, device=b.device).half()
    base = b.measure(F.linear, x0, w16)
    del w16
    g = k // b.sizes["group_size"]
    nbytes = {"gptq_matmul": k * k // 2 + g * k * 2.5, "awq_matmul": k * k // 2 + g * k * 2.5,
              "w8a16_matmul": k * k + 2 * k}
    for name, fn, args, w_ref in sc.dequant_cases(b.gen, b.device, m, k, b.sizes["group_size"]):
        ref = args[0].float() @ w_ref.float()
        del w_ref
        tried = []
        for cfg in SWEEP.get(m, [None]) if torch.cuda.is_available() else [None]:
            try:
                err = sc.rel_err(fn(*args, config=cfg), ref)
                t = b.measure(partial(fn, config=cfg), *args, eager=cfg is None or m > 1)
                tried.append((t, cfg, err))
            except Exception as e:  # noqa: BLE001 - one bad tile config must not hide the rest
                b.errors.append({"section": f"dequant {name} M={m} K={k} {cfg}",
                                 "error": repr(e)[:300]})
        if not tried:  # every config failed (errors recorded above): the next kernel
            continue
        t, cfg, err = min(tried, key=lambda r: r[0]["ms"])
        b.add(name, f"M={m} K={k} N={k}", t, "fp16 F.linear", base, nbytes=nbytes[name],
              flops=2.0 * m * k * k,
              config=str(cfg or dq.default_config(m, k, k, name.split("_")[0])),
              configs_tried={str(c): r["ms"] for r, c, _ in tried}, rel_err=err,
              worst_rel_err_over_configs=max(r[2] for r in tried))


def sec_memory_bound(b: Bench) -> None:
    """NF4 dequantize, reshape_and_cache, rms_norm and rotary: GB/s against copy bandwidth."""
    from labkit.kernels import reshape_and_cache as rc
    from labkit.kernels import rms_norm, rotary_embedding

    _nf4_dequantize_case(b)

    hq, hkv, d = b.sizes["heads"]
    bs, n = b.sizes["block_size"], b.sizes["cache_tokens"]
    key, val = (torch.randn(n, hkv, d, generator=b.gen, device=b.device).to(BF16)
                for _ in range(2))
    kc = torch.empty(4 * n // bs, bs, hkv, d, dtype=BF16, device=b.device)
    vc = torch.empty_like(kc)
    slots = torch.randperm(kc.shape[0] * bs, generator=b.gen, device=b.device)[:n]

    def index_copy(key, val, kc, vc):  # torch's scatter, no -1 slots here
        kc.view(-1, hkv, d).index_copy_(0, slots, key)
        vc.view(-1, hkv, d).index_copy_(0, slots, val)

    b.add("reshape_and_cache", f"N={n} Hkv={hkv} D={d} bf16",
          b.measure(partial(rc.reshape_and_cache, slot_mapping=slots), key, val, kc, vc),
          "torch index_copy_", b.measure(index_copy, key, val, kc, vc),
          nbytes=2 * 2 * key.numel() * 2)

    rows, hidden = b.sizes["norm"]
    x, r = (torch.randn(rows, hidden, generator=b.gen, device=b.device).to(BF16)
            for _ in range(2))
    w = torch.rand(hidden, generator=b.gen, device=b.device).to(BF16)
    b.add("rms_norm (+residual)", f"{rows}x{hidden} bf16",
          b.measure(lambda x, r: rms_norm.rms_norm(x, w, 1e-6, r), x, r), "torch eager",
          b.measure(lambda x, r: rms_norm.rms_norm_ref(x, w, 1e-6, r), x, r),
          nbytes=4 * x.numel() * 2)
    cache = rotary_embedding.build_cos_sin_cache(8192, d, device=b.device)
    pos = torch.randint(0, 8192, (n,), generator=b.gen, device=b.device)
    qq = torch.randn(n, hq, d, generator=b.gen, device=b.device).to(BF16)
    kk = torch.randn(n, hkv, d, generator=b.gen, device=b.device).to(BF16)
    b.add("rotary_embedding", f"N={n} Hq={hq} Hkv={hkv} D={d} bf16",
          b.measure(lambda q, k: rotary_embedding.rotary_embedding(pos, q, k, cache), qq, kk),
          "torch eager",
          b.measure(lambda q, k: rotary_embedding.rotary_embedding_ref(pos, q, k, cache), qq, kk),
          nbytes=2 * (qq.numel() + kk.numel()) * 2)


def _nf4_dequantize_case(b: Bench) -> None:
    """NF4 dequantize against the torch lookup and, where installed, bitsandbytes: the one
    memory-bound kernel with a library to beat."""
    from labkit.kernels import nf4

    rows, cols = b.sizes["nf4"]
    numel = rows * cols
    packed = torch.randint(0, 256, (numel // 2,), dtype=torch.uint8, device=b.device,
                           generator=b.gen)
    absmax = torch.rand(numel // 64, generator=b.gen, device=b.device)
    t = b.measure(partial(nf4.nf4_dequantize, blocksize=64, shape=(rows, cols)), packed, absmax)
    base = b.measure(partial(nf4.nf4_dequantize_ref, blocksize=64, shape=(rows, cols)), packed,
                     absmax)
    nbytes = numel // 2 + 2 * numel + 4 * numel // 64
    b.add("nf4_dequantize", f"{rows}x{cols} bs=64 ->fp16", t, "torch lookup", base,
          nbytes=nbytes)
    try:
        from bitsandbytes.functional import QuantState, dequantize_4bit
        qs = QuantState(absmax=absmax, shape=torch.Size((rows, cols)), blocksize=64,
                        code=nf4._code(packed.device), quant_type="nf4", dtype=torch.float16)
        bnb = b.measure(lambda p: dequantize_4bit(p.view(-1, 1), qs), packed)
        b.add("nf4_dequantize", f"{rows}x{cols} bs=64 ->fp16", t, "bitsandbytes", bnb,
              nbytes=nbytes)
    except ImportError:
        print("  bitsandbytes not installed: NF4 compared with the torch lookup only")


def sec_tuning(b: Bench) -> None:
    """Tile variants at the two headline attention shapes, so one run shows what the defaults
    leave on the table (rows are labelled with their config; the defaults are rows above)."""
    from labkit.kernels.paged_attention import paged_attention_decode
    from labkit.kernels.paged_prefill import paged_prefill_attention

    hq, hkv, d = b.sizes["heads"]
    bs, scale = b.sizes["block_size"], d**-0.5
    nseq, ctx = b.sizes["tune_decode"]
    q, kc, vc, bt, lens = sc.paged_setup(nseq, ctx, (hq, hkv, d), bs, BF16, b.device, b.gen)
    ref = paged_attention_decode(q, kc, vc, bt, lens, scale, 1)
    for block_n, warps, stages in b.sizes["decode_configs"]:
        def dec(q, kc, vc, bn=block_n, w=warps, st=stages):
            return paged_attention_decode(q, kc, vc, bt, lens, scale, 1, bn, w, st)
        try:
            err = sc.rel_err(dec(q, kc, vc), ref)
            t = b.measure(dec, q, kc, vc, eager=False)
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: skip the variant
            b.errors.append({"section": f"tuning decode {block_n}/{warps}/{stages}",
                             "error": repr(e)[:300]})
            continue
        b.add("paged_attention_decode (variant)", f"B={nseq} ctx={ctx} BLOCK_N={block_n} "
              f"warps={warps} stages={stages}", t, nbytes=2 * nseq * ctx * hkv * d * 2,
              rel_err_vs_default=err)
    del q, kc, vc
    nseq, qlen = b.sizes["tune_prefill"]
    q, kc, vc, bt, lens = sc.paged_setup(nseq, qlen, (hq, hkv, d), bs, BF16, b.device, b.gen,
                                       q_tokens=nseq * qlen)
    qsl = torch.arange(nseq + 1, device=b.device, dtype=torch.int32) * qlen
    ref = paged_prefill_attention(q, kc, vc, bt, qsl, lens, scale, qlen)
    flops = 4.0 * nseq * hq * d * qlen * (qlen + 1) // 2
    for bm, bn, warps, stages in b.sizes["prefill_configs"]:
        def pre(q, kc, vc, bm=bm, bn=bn, w=warps, st=stages):
            return paged_prefill_attention(q, kc, vc, bt, qsl, lens, scale, qlen, bm, bn, w, st)
        try:
            err = sc.rel_err(pre(q, kc, vc), ref)
            t = b.measure(pre, q, kc, vc, eager=False)
        except Exception as e:  # noqa: BLE001 - e.g. out of shared memory: skip the variant
            b.errors.append({"section": f"tuning prefill {bm}/{bn}/{warps}/{stages}",
                             "error": repr(e)[:300]})
            continue
        b.add("paged_prefill_attention (variant)", f"{nseq} seqs q_len={qlen} BLOCK_M={bm} "
              f"BLOCK_N={bn} warps={warps} stages={stages}", t, flops=flops,
              rel_err_vs_default=err)


SECTIONS = [("copy bandwidth", sec_copy), ("correctness", sec_checks),
            ("correctness, odd shapes", sec_odd_shapes), ("decode", sec_decode),
            ("decode, int8 KV", sec_decode_int8),
            ("prefill", sec_prefill), ("dequant", sec_dequant),
            ("memory-bound", sec_memory_bound), ("tuning", sec_tuning)]


def run(sizes: dict, device: str, partial_json: Path | None = None) -> dict[str, Any]:
    """Every section in order; returns the JSON payload (also saved after each section to
    ``partial_json`` so a run cut short still leaves its numbers)."""
    b = Bench(sizes, device)
    for name, fn in SECTIONS:
        print(f"== {name}", flush=True)
        b.guarded(name, lambda fn=fn: fn(b))
        if partial_json is not None:
            write_json(partial_json, {**b.payload(), "partial": True})
    return b.payload()


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("kernels", __doc__.splitlines()[0])
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("labkit bench kernels needs a CUDA GPU: it times Triton kernels against the "
              "device's copy bandwidth and cuBLAS/SDPA baselines, which mean nothing on CPU. "
              "The kernels' correctness tests run on CPU: pytest tests/kernels "
              "(TRITON_INTERPRET=1).", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    default = DEFAULT_JSON.with_name("kernels-quick.json") if args.quick else DEFAULT_JSON
    json_path = Path(args.json) if args.json else default
    payload = run(QUICK if args.quick else FULL, "cuda", partial_json=json_path)
    payload["wall_s"] = time.perf_counter() - t0
    write_json(json_path, payload)
    md = to_markdown(payload)
    json_path.with_suffix(".md").write_text(md)
    print(md)
    print_table(payload["results"], ["kernel", "shape", "ms", "achieved_gbps", "tflops",
                                     "speedup_vs_baseline"])
    failed = [c for c in payload["checks"] if not c["ok"]]
    return 1 if failed or payload["errors"] else 0

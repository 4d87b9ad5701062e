"""Every kernel against its plain-PyTorch reference at a given size, on fresh random inputs.

``labkit bench kernels`` runs this first on the GPU at realistic sizes (before timing anything);
the tests run it at toy sizes under the interpreter. Each check reports a relative error
``||out - ref|| / ||ref||`` against a tolerance fitting the dtype.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

BF16 = torch.bfloat16
Report = Callable[[str, str, float, float], None]  # (kernel, shape, rel_err, tol)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf when out has NaN/inf."""
    out, ref = out.double(), ref.double()
    if not torch.isfinite(out).all():
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def paged_setup(num_seqs: int, ctx: int, heads: tuple[int, int, int], block_size: int,
                dtype: torch.dtype, device: str, gen: torch.Generator,
                q_tokens: int | None = None):
    """Random caches with every sequence's blocks at shuffled physical places."""
    hq, hkv, d = heads
    per_seq = math.ceil(ctx / block_size)
    num_blocks = num_seqs * per_seq + 3
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=gen, device=device,
                          dtype=torch.float32).to(dtype)
    v_cache = torch.randn(k_cache.shape, generator=gen, device=device).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=device)[: num_seqs * per_seq]
    block_tables = perm.view(num_seqs, per_seq).to(torch.int32)
    context_lens = torch.full((num_seqs,), ctx, dtype=torch.int32, device=device)
    q = torch.randn(q_tokens or num_seqs, hq, d, generator=gen, device=device).to(dtype)
    return q, k_cache, v_cache, block_tables, context_lens


def randint32(gen: torch.Generator, device: str, *shape: int) -> torch.Tensor:
    """Uniform random int32 words: every nibble pattern is a valid packed 4-bit weight."""
    return torch.randint(-(2**31), 2**31 - 1, shape, dtype=torch.int32, device=device,
                         generator=gen)


def check_all(report: Report, sizes: dict, device: str, gen: torch.Generator) -> None:
    """Every kernel against its plain-PyTorch reference at one realistic size, fresh inputs."""
    _check_paged_attention(report, sizes, device, gen)
    _check_cache_write(report, sizes, device, gen)
    _check_norm_rope(report, sizes, device, gen)
    _check_dequant(report, sizes, device, gen)


def _check_paged_attention(report: Report, sizes: dict, device: str,
                           gen: torch.Generator) -> None:
    """Decode (single pass and split-KV) on ragged contexts, prefill on a staggered batch."""
    from labkit.kernels import paged_attention, paged_prefill

    hq, hkv, d = sizes["heads"]
    bs = sizes["block_size"]
    nseq, ctx = sizes["check"]["decode"]
    q, kc, vc, bt, _ = paged_setup(nseq, ctx, (hq, hkv, d), bs, BF16, device, gen)
    lens = torch.randint(1, ctx + 1, (nseq,), generator=gen, device=device).int()
    ref = paged_attention.paged_attention_decode_ref(q, kc, vc, bt, lens, d**-0.5)
    for splits in (1, None):
        out = paged_attention.paged_attention_decode(q, kc, vc, bt, lens, d**-0.5, splits)
        report(f"paged_attention_decode split={splits or 'auto'}", f"B={nseq} ctx<={ctx} bf16",
                rel_err(out, ref), 1e-2)
    nseq, qlen, ctx = sizes["check"]["prefill"]
    q, kc, vc, bt, _ = paged_setup(nseq, ctx, (hq, hkv, d), bs, BF16, device, gen,
                                    q_tokens=nseq * qlen)
    qsl = torch.arange(nseq + 1, device=device, dtype=torch.int32) * qlen
    lens = torch.tensor([ctx - i * (ctx - qlen) // max(nseq - 1, 1) for i in range(nseq)],
                        dtype=torch.int32, device=device)
    out = paged_prefill.paged_prefill_attention(q, kc, vc, bt, qsl, lens, d**-0.5)
    ref = paged_prefill.paged_prefill_attention_ref(q, kc, vc, bt, qsl, lens, d**-0.5)
    report("paged_prefill_attention", f"{nseq} seqs q_len={qlen} ctx<={ctx} bf16",
            rel_err(out, ref), 1e-2)


def _check_cache_write(report: Report, sizes: dict, device: str, gen: torch.Generator) -> None:
    """reshape_and_cache into shuffled slots with -1 padding: the caches must be bit-equal."""
    from labkit.kernels import reshape_and_cache as rc

    _, hkv, d = sizes["heads"]
    bs = sizes["block_size"]
    n = sizes["cache_tokens"]
    key, val = (torch.randn(n, hkv, d, generator=gen, device=device).to(BF16)
                for _ in range(2))
    kc = torch.zeros(2 * n // bs + 1, bs, hkv, d, dtype=BF16, device=device)
    vc, kc2, vc2 = kc.clone(), kc.clone(), kc.clone()
    slots = torch.randperm(kc.shape[0] * bs, generator=gen, device=device)[:n]
    slots[:: max(n // 7, 1)] = -1
    rc.reshape_and_cache(key, val, kc, vc, slots)
    rc.reshape_and_cache_ref(key, val, kc2, vc2, slots)
    report("reshape_and_cache", f"N={n} (with -1 slots)",
            float(not (torch.equal(kc, kc2) and torch.equal(vc, vc2))), 0.0)


def _check_norm_rope(report: Report, sizes: dict, device: str, gen: torch.Generator) -> None:
    """Fused RMSNorm (+ residual add) and in-place RoPE on random positions, bf16."""
    from labkit.kernels import rms_norm, rotary_embedding

    hq, hkv, d = sizes["heads"]
    n = sizes["cache_tokens"]
    rows, hidden = sizes["norm"]
    x, r = (torch.randn(rows, hidden, generator=gen, device=device).to(BF16)
            for _ in range(2))
    w = torch.rand(hidden, generator=gen, device=device).to(BF16) + 0.5
    (y, h), (y2, h2) = rms_norm.rms_norm(x, w, 1e-6, r), rms_norm.rms_norm_ref(x, w, 1e-6, r)
    report("rms_norm (+residual)", f"{rows}x{hidden} bf16", max(rel_err(y, y2),
                                                                  rel_err(h, h2)), 1e-2)
    cache = rotary_embedding.build_cos_sin_cache(8192, d, 500000.0, device=device)
    pos = torch.randint(0, 8192, (n,), generator=gen, device=device)
    qq = torch.randn(n, hq, d, generator=gen, device=device).to(BF16)
    kk = torch.randn(n, hkv, d, generator=gen, device=device).to(BF16)
    qr, kr = rotary_embedding.rotary_embedding_ref(pos, qq, kk, cache)
    rotary_embedding.rotary_embedding(pos, qq, kk, cache)
    report("rotary_embedding", f"N={n} Hq={hq} Hkv={hkv} D={d} bf16",
            max(rel_err(qq, qr), rel_err(kk, kr)), 1e-2)


def _check_dequant(report: Report, sizes: dict, device: str, gen: torch.Generator) -> None:
    """The quantized matmuls at M = 1 (GEMV kernels) and M > 1 (GEMM), and NF4 dequantize."""
    from labkit.kernels import nf4

    m, k = sizes["check"]["dequant"]
    for rows in (1, m):  # M = 1 runs the GEMV kernels, M > 1 the tensor-core GEMM
        for name, fn, args, w_ref in dequant_cases(gen, device, rows, k, sizes["group_size"],
                                                   act_order=True):
            report(name, f"M={rows} K=N={k} fp16",
                   rel_err(fn(*args), args[0].float() @ w_ref.float()), 5e-3)
    packed = torch.randint(0, 256, (k * k // 2,), dtype=torch.uint8, device=device,
                           generator=gen)
    absmax = torch.rand(k * k // 64, generator=gen, device=device)
    report("nf4_dequantize", f"{k}x{k} blocksize 64",
            rel_err(nf4.nf4_dequantize(packed, absmax, 64, (k, k)),
                     nf4.nf4_dequantize_ref(packed, absmax, 64, (k, k))), 1e-3)


def dequant_cases(gen: torch.Generator, device: str, m: int, k: int, group_size: int,
                  act_order: bool = False):
    """(name, fn(*args, config), args, W reference [K, N]) for GPTQ, AWQ, W8A16, N = K."""
    from labkit.kernels import dequant_matmul as dq

    n, gs = k, group_size
    g = k // gs
    x = torch.randn(m, k, generator=gen, device=device).half()
    sc = (torch.rand(g, n, generator=gen, device=device) * 0.01 + 1e-3).half()
    qw, qz = randint32(gen, device, k // 8, n), randint32(gen, device, g, n // 8)
    gidx = (torch.arange(k, device=device) // gs).int()
    cases = [("gptq_matmul", dq.gptq_matmul, (x, qw, qz, sc, gidx),
              dq.gptq_dequantize_ref(qw, qz, sc, gidx))]
    if act_order:
        perm = gidx[torch.randperm(k, generator=gen, device=device)].contiguous()
        cases.append(("gptq_matmul act-order", dq.gptq_matmul, (x, qw, qz, sc, perm),
                      dq.gptq_dequantize_ref(qw, qz, sc, perm)))
    aw, az = randint32(gen, device, k, n // 8), randint32(gen, device, g, n // 8)
    cases.append(("awq_matmul", dq.awq_matmul, (x, aw, az, sc, gs),
                  dq.awq_dequantize_ref(aw, az, sc, gs)))
    w8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=device, generator=gen)
    s8 = (torch.rand(n, generator=gen, device=device) * 0.01 + 1e-3).half()
    cases.append(("w8a16_matmul", dq.w8a16_matmul, (x, w8, s8), dq.w8a16_dequantize_ref(w8, s8)))
    return cases


def check_odd_shapes(report: Report, device: str, gen: torch.Generator) -> None:
    """Shapes real models have and the headline sizes do not: head_dim 80/96 (padded tiles),
    GQA 7 (Qwen2-0.5B: 14 q over 2 kv heads), blocks of 8 and 32, ragged contexts, prefix-hit
    prefill, GEMV/GEMM on N no tile divides and K of three groups, norm/RoPE widths that are
    not powers of two. Small, so it adds seconds, on the device the timings come from."""
    _odd_paged_attention(report, device, gen)
    _odd_dequant(report, device, gen)
    _odd_norm_rope(report, device, gen)
    check_moe_and_lora(report, device, gen)


def _odd_paged_attention(report: Report, device: str, gen: torch.Generator) -> None:
    """Decode and prefix-hit prefill at GQA 7 / head_dim 80 / head_dim 96, blocks of 8-32."""
    from labkit.kernels import paged_attention, paged_prefill

    f16 = torch.float16
    for (hq, hkv, d), bs in (((14, 2, 64), 8), ((8, 8, 80), 32), ((12, 4, 96), 16)):
        q, kc, vc, bt, _ = paged_setup(3, 70, (hq, hkv, d), bs, f16, device, gen)
        lens = torch.tensor([1, bs + 1, 70], dtype=torch.int32, device=device)
        ref = paged_attention.paged_attention_decode_ref(q, kc, vc, bt, lens, d**-0.5)
        for splits in (1, 4):
            out = paged_attention.paged_attention_decode(q, kc, vc, bt, lens, d**-0.5, splits)
            report(f"paged_attention_decode splits={splits}",
                   f"Hq={hq} Hkv={hkv} D={d} bs={bs} ctx 1/{bs + 1}/70 fp16",
                   rel_err(out, ref), 5e-3)
        q, kc, vc, bt, _ = paged_setup(2, 70, (hq, hkv, d), bs, f16, device, gen, q_tokens=50)
        qsl = torch.tensor([0, 20, 50], dtype=torch.int32, device=device)
        plens = torch.tensor([70, 30], dtype=torch.int32, device=device)  # 50 and 0 cached
        out = paged_prefill.paged_prefill_attention(q, kc, vc, bt, qsl, plens, d**-0.5)
        ref = paged_prefill.paged_prefill_attention_ref(q, kc, vc, bt, qsl, plens, d**-0.5)
        report("paged_prefill_attention", f"Hq={hq} Hkv={hkv} D={d} bs={bs} prefix hit fp16",
               rel_err(out, ref), 5e-3)


def _odd_dequant(report: Report, device: str, gen: torch.Generator) -> None:
    """Every quantized matmul on N = 200 (no tile divides it) and K of three groups."""
    from labkit.kernels import dequant_matmul as dq

    f16 = torch.float16
    k, n, gs = 192, 200, 64
    x = torch.randn(3, k, generator=gen, device=device).to(f16)
    sc = (torch.rand(k // gs, n, generator=gen, device=device) * 0.01 + 1e-3).to(f16)
    qw, qz = randint32(gen, device, k // 8, n), randint32(gen, device, k // gs, n // 8)
    gidx = (torch.arange(k, device=device) // gs).int()
    act = gidx[torch.randperm(k, generator=gen, device=device)].contiguous()
    aw = randint32(gen, device, k, n // 8)
    w8 = torch.randint(-128, 128, (n, k), dtype=torch.int8, device=device, generator=gen)
    cases = [("gptq_matmul", dq.gptq_matmul, (qw, qz, sc, gidx),
              dq.gptq_dequantize_ref(qw, qz, sc, gidx)),
             ("gptq_matmul act-order", dq.gptq_matmul, (qw, qz, sc, act),
              dq.gptq_dequantize_ref(qw, qz, sc, act)),
             ("awq_matmul", dq.awq_matmul, (aw, qz, sc, gs), dq.awq_dequantize_ref(aw, qz, sc, gs)),
             ("w8a16_matmul", dq.w8a16_matmul, (w8, sc[0]), dq.w8a16_dequantize_ref(w8, sc[0]))]
    for name, fn, args, w_ref in cases:
        for rows in (1, 3):  # GEMV, then the tensor-core GEMM
            report(name, f"M={rows} K={k} N={n} fp16",
                   rel_err(fn(x[:rows], *args), x[:rows].float() @ w_ref.float()), 5e-3)


def _odd_norm_rope(report: Report, device: str, gen: torch.Generator) -> None:
    """RMSNorm at Qwen2-0.5B's widths (896, 4864) and RoPE at head_dim 80, fp16."""
    from labkit.kernels import rms_norm, rotary_embedding

    f16 = torch.float16
    for width in (896, 4864):
        xs, res = (torch.randn(5, width, generator=gen, device=device).to(f16) for _ in range(2))
        w = torch.rand(width, generator=gen, device=device).to(f16) + 0.5
        (y, h), (y2, h2) = rms_norm.rms_norm(xs, w, 1e-6, res), rms_norm.rms_norm_ref(xs, w, 1e-6,
                                                                                     res)
        report("rms_norm (+residual)", f"5x{width} fp16", max(rel_err(y, y2), rel_err(h, h2)),
               5e-3)
    cache = rotary_embedding.build_cos_sin_cache(512, 80, 10000.0, device=device)
    pos = torch.randint(0, 512, (9,), generator=gen, device=device)
    qq = torch.randn(9, 14, 80, generator=gen, device=device).to(f16)
    kk = torch.randn(9, 2, 80, generator=gen, device=device).to(f16)
    qr, kr = rotary_embedding.rotary_embedding_ref(pos, qq, kk, cache)
    rotary_embedding.rotary_embedding(pos, qq, kk, cache)
    report("rotary_embedding", "N=9 Hq=14 Hkv=2 D=80 fp16", max(rel_err(qq, qr), rel_err(kk, kr)),
           5e-3)


def check_moe_and_lora(report: Report, device: str, gen: torch.Generator) -> None:
    """fused_moe (prefill- and decode-sized routing, an intermediate size no tile divides) and
    the multi-LoRA kernels (mixed slots with base rows, segments with an empty one) in bf16."""
    from labkit.kernels import fused_moe as fm
    from labkit.kernels import lora_ops as lo

    h, inter, e, k = 128, 96, 8, 2
    w13 = (torch.randn(e, 2 * inter, h, generator=gen, device=device) / h**0.5).to(BF16)
    w2 = (torch.randn(e, h, inter, generator=gen, device=device) / inter**0.5).to(BF16)
    for t in (21, 3):
        x = torch.randn(t, h, generator=gen, device=device).to(BF16)
        probs = torch.softmax(torch.randn(t, e, generator=gen, device=device), -1)
        weights, ids = probs.topk(k, -1)
        report("fused_moe", f"T={t} H={h} I={inter} E={e} top-{k} bf16",
               rel_err(fm.fused_moe(x, w13, w2, weights, ids),
                       fm.fused_moe_ref(x, w13, w2, weights, ids)), 1e-2)
    t, h_in, h_out, r = 24, 128, 160, 16
    a = (torch.randn(3, r, h_in, generator=gen, device=device) / h_in**0.5).to(BF16)
    b = (torch.randn(3, h_out, r, generator=gen, device=device) / r**0.5).to(BF16)
    scalings = torch.tensor([2.0, 0.5, 1.0], device=device)
    x = torch.randn(t, h_in, generator=gen, device=device).to(BF16)
    y0 = torch.randn(t, h_out, generator=gen, device=device).to(BF16)
    slots = torch.randint(-1, 3, (t,), generator=gen, device=device)
    y, y_ref = y0.clone(), y0.clone()
    lo.add_lora(y, x, a, b, slots, scalings)
    lo.add_lora_ref(y_ref, x, a, b, slots, scalings)
    report("bgmv (add_lora)", f"T={t} H_in={h_in} H_out={h_out} r={r} 3 slots + base bf16",
           rel_err(y.float() - y0.float(), y_ref.float() - y0.float()), 1e-2)
    starts = torch.tensor([0, 5, 5, 20, 24], device=device)
    seg_slots = torch.tensor([1, 0, 2, -1], device=device)
    y, y_ref = y0.clone(), y0.clone()
    lo.sgmv_expand(y, lo.sgmv_shrink(x, a, starts, seg_slots), b, starts, seg_slots, scalings)
    lo.sgmv_expand_ref(y_ref, lo.sgmv_shrink_ref(x, a, starts, seg_slots), b, starts,
                       seg_slots, scalings)
    report("sgmv (shrink+expand)", f"T={t} segments 5/0/15/4 (base) r={r} bf16",
           rel_err(y.float() - y0.float(), y_ref.float() - y0.float()), 1e-2)

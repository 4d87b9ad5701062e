"""Fuzz every kernel on seeded random shapes against references written here from first principles.

The references share no code with ``labkit.kernels``: paged attention gathers K/V token by token
through the block table in a Python loop and runs a float64 softmax with an explicit GQA head map;
the quantized formats are packed here with plain bit operations from the layouts in
interfaces.md and dequantised from the codes in float64; NF4 uses bitsandbytes' own quantizer and
code table; rms_norm and RoPE are float64 formulas, RoPE also against transformers' rotate_half.

Shapes go beyond the hand-picked tests: head_dim 64/80/96/112/128/256, GQA 1/2/3/4/7/8, block sizes
8..64, contexts of 1, block_size - 1, block_size, block_size + 1 and long ones in one batch,
scattered physical blocks (unused slots hold NaN, so reading one shows), prefix hits, more splits
than blocks, odd M/K/N for the dequant kernels, act-order GPTQ. Each case is a seed; its shape is
in the assertion message. Tolerances (interpreter rounds fp32 -> fp16/bf16 toward zero, 1 ulp):
fp32 1e-5, fp16 2e-3, bf16 1.6e-2, relative and absolute.
"""

from __future__ import annotations

import math
import random

import pytest
import torch
from labkit.kernels.dequant_matmul import awq_matmul, gptq_matmul, w8a16_matmul
from labkit.kernels.nf4 import nf4_dequantize
from labkit.kernels.paged_attention import paged_attention_decode
from labkit.kernels.paged_prefill import paged_prefill_attention
from labkit.kernels.reshape_and_cache import reshape_and_cache
from labkit.kernels.rms_norm import rms_norm
from labkit.kernels.rotary_embedding import build_cos_sin_cache, rotary_embedding

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
DTYPES = (F32, F16, BF16)
TOL = {F32: 1e-5, F16: 2e-3, BF16: 1.6e-2}
HEAD_DIMS = (64, 80, 96, 112, 128, 256)
GQA = (1, 2, 3, 4, 7, 8)
BLOCK_SIZES = (8, 16, 32, 64)


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, what: str,
           tol: float | None = None) -> None:
    tol = TOL[dtype] if tol is None else tol
    out64 = out.double()
    assert torch.isfinite(out64).all(), f"non-finite output: {what}"
    err = (out64 - ref).abs() - tol * ref.abs()
    worst = float(err.max()) if err.numel() else 0.0
    assert worst <= tol, f"max excess error {worst:.3g} (tol {tol}): {what}"


# ------------------------------------------------------------------ paged attention references


def _paged_cache(r: random.Random, gen: torch.Generator, lens: list[int], hkv: int, d: int,
                 bs: int, dtype: torch.dtype):
    """Caches whose blocks sit at shuffled physical ids (block 0 is a spare, as padding points
    there); every slot no sequence owns holds NaN. Returns caches, tables [B, width] int32."""
    per_seq = [max(1, -(-n // bs)) for n in lens]
    num_blocks = 1 + sum(per_seq) + r.randint(0, 3)
    ids = list(range(1, num_blocks))
    r.shuffle(ids)
    k_cache = torch.full((num_blocks, bs, hkv, d), float("nan"), dtype=dtype)
    v_cache = torch.full_like(k_cache, float("nan"))
    width = max(per_seq) + r.randint(0, 2)
    tables = torch.zeros(len(lens), width, dtype=torch.int32)  # padded with 0 (interfaces.md)
    for b, n in enumerate(lens):
        for i in range(per_seq[b]):
            tables[b, i] = ids.pop()
        for t in range(n):
            blk, off = int(tables[b, t // bs]), t % bs
            k_cache[blk, off] = torch.randn(hkv, d, generator=gen).to(dtype)
            v_cache[blk, off] = torch.randn(hkv, d, generator=gen).to(dtype)
    return k_cache, v_cache, tables


def _attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   table: torch.Tensor, ctx_len: int, q_positions: list[int],
                   scale: float) -> torch.Tensor:
    """q [T, Hq, D] at q_positions over the first ctx_len tokens of one sequence; float64."""
    bs, hkv = k_cache.shape[1], k_cache.shape[2]
    keys = torch.stack([k_cache[int(table[t // bs]), t % bs] for t in range(ctx_len)]).double()
    vals = torch.stack([v_cache[int(table[t // bs]), t % bs] for t in range(ctx_len)]).double()
    hq = q.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64)
    for h in range(hq):
        kv = h // (hq // hkv)  # query head h reads kv head h // group
        s = q[:, h].double() @ keys[:, kv].T * scale  # [T, ctx]
        visible = torch.arange(ctx_len)[None, :] <= torch.tensor(q_positions)[:, None]
        s = s.masked_fill(~visible, float("-inf"))
        p = torch.exp(s - s.max(-1, keepdim=True).values)
        out[:, h] = (p / p.sum(-1, keepdim=True)) @ vals[:, kv]
    return out


def _lens(r: random.Random, bs: int, count: int, longest: int) -> list[int]:
    picks = [1, bs - 1, bs, bs + 1, r.randint(2, 3 * bs), r.randint(bs, longest)]
    return [max(1, r.choice(picks)) for _ in range(count)]


def _decode_case(seed: int):
    r = random.Random(seed)
    d = HEAD_DIMS[seed % len(HEAD_DIMS)]
    group = GQA[(seed // 2) % len(GQA)]
    hkv = r.choice((1, 2)) if group > 3 else r.choice((1, 2, 3))
    bs = BLOCK_SIZES[(seed // 3) % len(BLOCK_SIZES)]
    dtype = DTYPES[seed % 3]
    lens = _lens(r, bs, r.randint(1, 4), 400 if d <= 128 else 120)
    blocks = -(-max(lens) // bs)
    splits = r.choice((1, None, 2, 3, blocks + 3))  # more splits than blocks: some are empty
    return d, group * hkv, hkv, bs, dtype, lens, splits


DECODE_SEEDS = range(40)


def _odd_layouts(seed: int, tables: torch.Tensor, lens: torch.Tensor):
    """Every fourth case: int64 metadata, the table column-major and the lengths a strided view
    (valid tensors whose strides the kernels must honour or normalise)."""
    if seed % 4 != 3:
        return tables, lens
    tables = tables.long().t().contiguous().t()
    lens = torch.stack([lens.long(), torch.zeros_like(lens.long())], 1)[:, 0]
    return tables, lens


@pytest.mark.parametrize("seed", DECODE_SEEDS)
def test_decode_fuzz(seed):
    d, hq, hkv, bs, dtype, lens, splits = _decode_case(seed)
    r, gen = random.Random(1000 + seed), torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = _paged_cache(r, gen, lens, hkv, d, bs, dtype)
    # q as a view into a fused qkv row (strided rows) on odd seeds, scaled for peaky softmax
    width = hq + 2 * hkv if seed % 2 else hq
    qkv = (torch.randn(len(lens), width * d, generator=gen) * r.choice((1.0, 3.0))).to(dtype)
    q = qkv[:, : hq * d].view(len(lens), hq, d)
    bt, ctx = _odd_layouts(seed, tables, torch.tensor(lens, dtype=torch.int32))
    scale = d**-0.5
    out = paged_attention_decode(q, k_cache, v_cache, bt, ctx, scale, num_splits=splits)
    what = f"decode D={d} Hq={hq} Hkv={hkv} bs={bs} {dtype} lens={lens} splits={splits}"
    assert out.shape == q.shape and out.dtype == dtype, what
    for b, n in enumerate(lens):
        ref = _attention_ref(q[b][None], k_cache, v_cache, tables[b], n, [n - 1], scale)[0]
        _close(out[b], ref, dtype, f"{what} seq {b}")


def _prefill_case(seed: int):
    r = random.Random(seed)
    d = HEAD_DIMS[(seed + 1) % len(HEAD_DIMS)]
    group = GQA[seed % len(GQA)]
    hkv = 1 if group > 3 else r.choice((1, 2))
    bs = BLOCK_SIZES[(seed // 2) % len(BLOCK_SIZES)]
    dtype = DTYPES[(seed + 2) % 3]
    ctx_lens, q_lens = [], []
    for _ in range(r.randint(1, 3)):
        n = max(1, r.choice((1, bs - 1, bs, bs + 1, r.randint(2, 90))))
        kind = r.choice(("full", "chunk", "one", "none"))  # q_len == ctx, < ctx (prefix hit)
        q_len = {"full": n, "chunk": r.randint(1, n), "one": 1, "none": 0}[kind]
        ctx_lens.append(n)
        q_lens.append(min(q_len, 70))
    if sum(q_lens) == 0:
        q_lens[0] = ctx_lens[0] = min(ctx_lens[0], 70)
    return d, group * hkv, hkv, bs, dtype, ctx_lens, q_lens


PREFILL_SEEDS = range(20)


@pytest.mark.parametrize("seed", PREFILL_SEEDS)
def test_prefill_fuzz(seed):
    d, hq, hkv, bs, dtype, ctx_lens, q_lens = _prefill_case(seed)
    r, gen = random.Random(2000 + seed), torch.Generator().manual_seed(seed)
    k_cache, v_cache, tables = _paged_cache(r, gen, ctx_lens, hkv, d, bs, dtype)
    starts = [0]
    for n in q_lens:
        starts.append(starts[-1] + n)
    width = hq + 2 * hkv if seed % 2 else hq  # odd seeds: q is a view into a fused qkv
    q = torch.randn(starts[-1], width * d, generator=gen).to(dtype)[:, : hq * d]
    q = q.reshape(starts[-1], hq, d)
    bt, ctx = _odd_layouts(seed, tables, torch.tensor(ctx_lens, dtype=torch.int32))
    qsl = torch.tensor(starts, dtype=ctx.dtype)
    scale = d**-0.5
    out = paged_prefill_attention(q, k_cache, v_cache, bt, qsl, ctx, scale)
    what = f"prefill D={d} Hq={hq} Hkv={hkv} bs={bs} {dtype} ctx={ctx_lens} q_lens={q_lens}"
    assert out.shape == q.shape and out.dtype == dtype, what
    for b, (n, ql) in enumerate(zip(ctx_lens, q_lens)):
        if ql == 0:
            continue
        s = starts[b]
        ref = _attention_ref(q[s:s + ql], k_cache, v_cache, tables[b], n,
                             list(range(n - ql, n)), scale)
        _close(out[s:s + ql], ref, dtype, f"{what} seq {b}")


@pytest.mark.parametrize("seed", range(6))
def test_reshape_and_cache_fuzz(seed):
    r, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    hkv, d, bs = r.choice((1, 2, 3, 4)), r.choice(HEAD_DIMS[:5]), r.choice(BLOCK_SIZES)
    dtype = DTYPES[seed % 3]
    num_blocks, n = r.randint(2, 5), r.randint(1, 40)
    slots = r.sample(range(num_blocks * bs), min(n, num_blocks * bs))
    slots += [-1] * (n - len(slots))
    for i in r.sample(range(n), n // 4):  # padding entries anywhere in the batch
        slots[i] = -1
    qkv = torch.randn(n, (2 + 2 * hkv) * d, generator=gen).to(dtype).view(n, 2 + 2 * hkv, d)
    key, value = qkv[:, 2:2 + hkv], qkv[:, 2 + hkv:]  # strided views, as from a fused qkv
    k_cache = torch.full((num_blocks, bs, hkv, d), 7.0, dtype=dtype)
    v_cache = torch.full_like(k_cache, -7.0)
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    for i, slot in enumerate(slots):
        if slot >= 0:
            k_exp[slot // bs, slot % bs] = key[i]
            v_exp[slot // bs, slot % bs] = value[i]
    reshape_and_cache(key, value, k_cache, v_cache, torch.tensor(slots, dtype=torch.int64))
    what = f"reshape_and_cache Hkv={hkv} D={d} bs={bs} {dtype} slots={slots}"
    assert torch.equal(k_cache, k_exp) and torch.equal(v_cache, v_exp), what


# ------------------------------------------------------------------ quantized weights


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words in [0, 2^32) as the int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _pack_along_rows(codes: torch.Tensor) -> torch.Tensor:
    """GPTQ: [8R, C] codes -> [R, C] int32; row 8r + j is nibble j (lowest first) of word r."""
    c = codes.to(torch.int64).reshape(-1, 8, codes.shape[1])
    return _to_int32(sum(c[:, j] << (4 * j) for j in range(8)))


def _pack_along_cols(codes: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """[R, 8C] codes -> [R, C] int32; nibble j of word c holds column 8c + order[j]."""
    c = codes.to(torch.int64).reshape(codes.shape[0], -1, 8)
    return _to_int32(sum(c[:, :, order[j]] << (4 * j) for j in range(8)))


def test_packers_by_hand():
    """The test's own packers against words written out by hand from the layout spec."""
    col = torch.tensor([[3], [14], [0], [7], [9], [1], [15], [6]])
    assert _pack_along_rows(col).item() == _to_int32(torch.tensor(0x6F19_70E3)).item()
    row = torch.arange(8)[None]  # column c holds code c
    assert _pack_along_cols(row, (0, 2, 4, 6, 1, 3, 5, 7)).item() == 0x7531_6420


M_VALUES = (1, 2, 3, 5, 16, 17, 33, 64)
N_VALUES = (8, 24, 40, 72, 104, 136)  # odd multiples of 8
REL = {F32: 1e-5, F16: 2e-3, BF16: 1e-2}


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return float((y.double() - ref).norm() / ref.norm().clamp_min(1e-30))


def _gptq_case(seed: int):
    r, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    m, n, dtype = M_VALUES[seed % len(M_VALUES)], r.choice(N_VALUES), DTYPES[seed % 3]
    kind = ("group", "act_order", "per_channel", "ragged")[seed % 4]
    gs = r.choice((32, 64, 128))
    if kind == "group":  # g_idx = k // gs, K a multiple of gs but not of the 128 tile
        k = gs * r.choice((1, 3, 5))
    elif kind == "per_channel":  # one group spans all of K
        k = r.choice((64, 96, 128, 256))
        gs = k
    else:  # act-order: groups permuted; ragged: K not a multiple of gs (last group short)
        k = 8 * r.randint(4, 40)
    g = -(-k // gs)
    g_idx = torch.arange(k) // gs
    if kind == "act_order":
        g_idx = g_idx[torch.randperm(k, generator=gen)]
    codes = torch.randint(0, 16, (k, n), generator=gen)
    zero_minus_1 = torch.randint(0, 15, (g, n), generator=gen)  # stored zero - 1
    scale_dtype = r.choice((F16, dtype))
    scales = (torch.rand(g, n, generator=gen) * 0.02 + 1e-3).to(scale_dtype)
    w = (codes - (zero_minus_1[g_idx] + 1)).double() * scales.double()[g_idx]  # [K, N]
    args = (_pack_along_rows(codes), _pack_along_rows(zero_minus_1.T.contiguous()).T.contiguous(),
            scales, g_idx.to(torch.int32))
    return m, k, n, dtype, kind, gs, scale_dtype, args, w


@pytest.mark.parametrize("seed", range(24))
def test_gptq_fuzz(seed):
    m, k, n, dtype, kind, gs, scale_dtype, args, w = _gptq_case(seed)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(100 + seed)).to(dtype)
    y = gptq_matmul(x, *args)
    what = f"gptq M={m} K={k} N={n} {dtype} {kind} group={gs} scales {scale_dtype}"
    assert y.shape == (m, n) and y.dtype == dtype, what
    rel = max(REL[dtype], REL[scale_dtype])
    assert _rel_err(y, x.double() @ w) < rel, what


@pytest.mark.parametrize("seed", range(12))
def test_awq_fuzz(seed):
    r, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    m, n, dtype = M_VALUES[(seed * 3) % len(M_VALUES)], r.choice(N_VALUES), DTYPES[seed % 3]
    gs = (32, 64, 128)[seed % 3]
    k = gs * r.choice((1, 2, 3, 5))
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    codes = torch.randint(0, 16, (k, n), generator=gen)
    zeros = torch.randint(0, 16, (k // gs, n), generator=gen)  # raw zeros
    scales = (torch.rand(k // gs, n, generator=gen) * 0.02 + 1e-3).half()
    groups = torch.arange(k) // gs
    w = (codes - zeros[groups]).double() * scales.double()[groups]
    x = torch.randn(m, k, generator=gen).to(dtype)
    y = awq_matmul(x, _pack_along_cols(codes, order), _pack_along_cols(zeros, order), scales, gs)
    what = f"awq M={m} K={k} N={n} {dtype} group={gs}"
    assert y.shape == (m, n) and y.dtype == dtype, what
    assert _rel_err(y, x.double() @ w) < max(REL[dtype], REL[F16]), what


@pytest.mark.parametrize("seed", range(8))
def test_w8a16_fuzz(seed):
    r, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    m, dtype = M_VALUES[(seed * 5) % len(M_VALUES)], DTYPES[seed % 3]
    n, k = r.randint(1, 150), r.randint(1, 300)  # any N, K: no packing constraint
    q = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    s = (torch.rand(n, generator=gen) * 0.02 + 1e-3).to(dtype)
    x = torch.randn(m, k, generator=gen).to(dtype)
    y = w8a16_matmul(x, q, s)
    what = f"w8a16 M={m} K={k} N={n} {dtype}"
    assert y.shape == (m, n) and y.dtype == dtype, what
    assert _rel_err(y, x.double() @ (q.double() * s.double()[:, None]).T) < REL[dtype], what


@pytest.mark.parametrize("seed", range(6))
def test_nf4_fuzz_against_bitsandbytes(seed):
    F = pytest.importorskip("bitsandbytes.functional")
    r, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    blocksize = (64, 128, 256)[seed % 3]
    shape = (r.randint(1, 9), r.randint(1, 300))  # numel rarely a multiple of the block
    dtype = DTYPES[seed % 3]
    w = torch.randn(*shape, generator=gen) * r.choice((0.01, 1.0, 30.0))
    packed, state = F.quantize_4bit(w, blocksize=blocksize, quant_type="nf4")
    ours = nf4_dequantize(packed, state.absmax, blocksize, shape, dtype)
    exact = nf4_dequantize(packed, state.absmax, blocksize, shape, F32)
    what = f"nf4 shape={shape} blocksize={blocksize} {dtype}"
    assert ours.shape == shape and ours.dtype == dtype, what
    # by hand from the layout: high nibble first, bitsandbytes' own code table, flat blocks
    table = state.code.double()
    b = packed.reshape(-1).long()
    codes = torch.stack([b >> 4, b & 0xF], 1).reshape(-1)[: w.numel()]
    absmax = state.absmax.double()[torch.arange(w.numel()) // blocksize]
    expect = (table[codes] * absmax).float().view(shape)  # one fp32 product, as bnb's
    assert torch.equal(exact, expect), what
    assert torch.equal(exact, F.dequantize_4bit(packed, state)), what
    # fp16/bf16: one rounding of that value (the interpreter truncates: allow 1 ulp)
    ulp = {F32: 0.0, F16: 2.0**-10, BF16: 2.0**-7}[dtype]
    torch.testing.assert_close(ours.float(), expect, atol=0, rtol=ulp, msg=what)


# ------------------------------------------------------------------ rms_norm and RoPE


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return x.to(dtype).double()


@pytest.mark.parametrize("seed", range(8))
def test_rms_norm_fuzz(seed):
    r, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    hidden = (896, 1000, 4864, 17, 3584, 100, 2048, 1)[seed]
    dtype, rows = DTYPES[seed % 3], r.randint(1, 4)
    with_residual, eps = seed % 2 == 0, r.choice((1e-5, 1e-6))
    # x as a column slice of a wider buffer (rows not contiguous with each other)
    x = (torch.randn(rows, hidden + 8, generator=gen) * 3).to(dtype)[:, :hidden]
    res = torch.randn(rows, hidden, generator=gen).to(dtype) if with_residual else None
    w = (torch.rand(hidden, generator=gen) + 0.5).to(dtype)
    out = rms_norm(x, w, eps, residual=res)
    h = _round(x.double() + res.double(), dtype) if with_residual else x.double()
    normed = _round(h / torch.sqrt((h * h).mean(-1, keepdim=True) + eps), dtype)
    y_ref = w.double() * normed
    what = f"rms_norm rows={rows} H={hidden} {dtype} residual={with_residual}"
    if with_residual:
        y, new_res = out
        _close(new_res, h, dtype, what + " (residual out)", tol=2 * TOL[dtype])
    else:
        y = out
        from transformers.models.llama.modeling_llama import LlamaRMSNorm

        hf = LlamaRMSNorm(hidden, eps).to(dtype)
        with torch.no_grad():
            hf.weight.copy_(w)
            _close(y, hf(x).double(), dtype, what + " vs transformers", tol=2 * TOL[dtype])
    _close(y, y_ref, dtype, what, tol=2 * TOL[dtype])


@pytest.mark.parametrize("seed", range(6))
def test_rotary_fuzz(seed):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    r, gen = random.Random(seed), torch.Generator().manual_seed(seed)
    d = (64, 80, 96, 128, 256, 32)[seed]
    hkv = r.choice((1, 2))
    hq, dtype = hkv * r.choice(GQA), DTYPES[seed % 3]
    n, max_pos, base = r.randint(1, 12), 1024, r.choice((10000.0, 1e6))
    positions = torch.tensor([r.randrange(max_pos) for _ in range(2 * n)])[::2]  # strided
    # q, k as views into one fused qkv projection output: strided rows, contiguous head_dim
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=gen).to(dtype).view(n, hq + 2 * hkv, d)
    q, k = qkv[:, :hq], qkv[:, hq:hq + hkv]
    q0, k0 = q.clone(), k.clone()
    cache = build_cos_sin_cache(max_pos, d, base)
    rotary_embedding(positions, q, k, cache)
    what = f"rotary N={n} Hq={hq} Hkv={hkv} D={d} {dtype} base={base}"
    # 1) transformers' rotate_half convention with the cache's cos/sin
    half = d // 2
    cos = cache[positions, :half].repeat(1, 2)[None]  # [1, N, D]
    sin = cache[positions, half:].repeat(1, 2)[None]
    q_hf, k_hf = apply_rotary_pos_emb(q0.double().transpose(0, 1)[None],
                                      k0.double().transpose(0, 1)[None],
                                      cos.double(), sin.double())
    _close(q, q_hf[0].transpose(0, 1), dtype, what + " q vs transformers")
    _close(k, k_hf[0].transpose(0, 1), dtype, what + " k vs transformers")
    # 2) float64 first principles: pair (i, i + D/2) rotated by pos * base^(-2i/D); the fp32
    #    cache's angle (pos up to 1024) is off by up to ~1e-4 rad, hence the looser bound
    i = torch.arange(half, dtype=torch.float64)
    ang = positions.double()[:, None, None] * base ** (-2 * i / d)
    for x0, x in ((q0.double(), q), (k0.double(), k)):
        a, b = x0[..., :half], x0[..., half:]
        ref = torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], -1)
        _close(x, ref, dtype, what + " vs float64", tol=max(TOL[dtype], 2e-3))


def test_rotary_strided_positions_regression():
    """positions[::2] used to be read as if contiguous (every token got the wrong angle)."""
    cache = build_cos_sin_cache(16, 8)
    positions = torch.tensor([3, 0, 9, 0, 14, 0])[::2]
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 2, 8, generator=gen), torch.randn(3, 1, 8, generator=gen)
    q0 = q.clone()
    rotary_embedding(positions, q, k, cache)
    ang = 9.0 * 10000.0 ** (-torch.arange(4, dtype=torch.float64) / 4)  # token 1 is at 9
    a, b = q0[1].double()[:, :4], q0[1].double()[:, 4:]
    ref = torch.cat([a * ang.cos() - b * ang.sin(), b * ang.cos() + a * ang.sin()], -1)
    _close(q[1], ref, F32, "rotary, strided positions")


# ------------------------------------------------------------------ bad input


def _attn_inputs():
    kc, vc = torch.zeros(4, 16, 2, 16), torch.zeros(4, 16, 2, 16)
    bt, ctx = torch.tensor([[0, 1]], dtype=torch.int32), torch.tensor([20], dtype=torch.int32)
    return torch.randn(1, 4, 16), kc, vc, bt, ctx


BAD = {
    "decode: q heads not a multiple of kv heads": (
        lambda q, kc, vc, bt, ctx: paged_attention_decode(q[:, :3], kc, vc, bt, ctx, 1.0),
        "multiple of num kv heads"),
    "decode: float context_lens": (
        lambda q, kc, vc, bt, ctx: paged_attention_decode(q, kc, vc, bt, ctx.float(), 1.0),
        "context_lens"),
    "decode: int8 q": (
        lambda q, kc, vc, bt, ctx: paged_attention_decode(q.to(torch.int8), kc.to(torch.int8),
                                                          vc.to(torch.int8), bt, ctx, 1.0),
        "fp16, bf16 or fp32"),
    "decode: context longer than its block table": (
        lambda q, kc, vc, bt, ctx: paged_attention_decode(q, kc, vc, bt, ctx + 20, 1.0),
        "block_tables"),
    "decode: empty context": (
        lambda q, kc, vc, bt, ctx: paged_attention_decode(q, kc, vc, bt, ctx * 0, 1.0),
        ">= 1"),
    "prefill: query_start_loc does not end at num_tokens": (
        lambda q, kc, vc, bt, ctx: paged_prefill_attention(
            torch.randn(3, 4, 16), kc, vc, bt, torch.tensor([0, 5], dtype=torch.int32), ctx,
            1.0), "query_start_loc"),
    "prefill: float query_start_loc": (
        lambda q, kc, vc, bt, ctx: paged_prefill_attention(
            torch.randn(5, 4, 16), kc, vc, bt, torch.tensor([0.0, 5.0]), ctx, 1.0),
        "query_start_loc"),
    "prefill: more new tokens than context": (
        lambda q, kc, vc, bt, ctx: paged_prefill_attention(
            torch.randn(25, 4, 16), kc, vc, bt, torch.tensor([0, 25], dtype=torch.int32), ctx,
            1.0), "context_lens"),
    "prefill: block_m not a power of two": (
        lambda q, kc, vc, bt, ctx: paged_prefill_attention(
            torch.randn(5, 4, 16), kc, vc, bt, torch.tensor([0, 5], dtype=torch.int32), ctx,
            1.0, block_m=24), "block_m"),
    "reshape_and_cache: float slot_mapping": (
        lambda q, kc, vc, bt, ctx: reshape_and_cache(
            torch.randn(3, 2, 16), torch.randn(3, 2, 16), kc, vc, torch.tensor([0.0, 1, 2])),
        "slot_mapping"),
    "reshape_and_cache: slot past the cache": (
        lambda q, kc, vc, bt, ctx: reshape_and_cache(
            torch.randn(3, 2, 16), torch.randn(3, 2, 16), kc, vc, torch.tensor([0, 1, 64])),
        "slot"),
    "rms_norm: residual dtype differs": (
        lambda *_: rms_norm(torch.randn(3, 8).half(), torch.ones(8).half(), 1e-6,
                            residual=torch.randn(3, 8)), "dtype"),
    "rms_norm: integer x": (
        lambda *_: rms_norm(torch.ones(3, 8, dtype=torch.int32), torch.ones(8), 1e-6),
        "fp16, bf16 or fp32"),
    "rms_norm: residual with a strided last dimension": (
        lambda *_: rms_norm(torch.randn(3, 8), torch.ones(8), 1e-6,
                            residual=torch.randn(8, 3).t()), "contiguous"),
    "rotary: odd head_dim": (
        lambda *_: rotary_embedding(torch.arange(3), torch.randn(3, 2, 15), torch.randn(3, 1, 15),
                                    torch.randn(8, 15)), "even"),
    "rotary: float positions": (
        lambda *_: rotary_embedding(torch.arange(3).float(), torch.randn(3, 2, 16),
                                    torch.randn(3, 1, 16), build_cos_sin_cache(8, 16)),
        "positions"),
    "rotary: position past the cache": (
        lambda *_: rotary_embedding(torch.tensor([0, 1, 8]), torch.randn(3, 2, 16),
                                    torch.randn(3, 1, 16), build_cos_sin_cache(8, 16)),
        "positions"),
    "gptq: 1-D qweight": (
        lambda *_: gptq_matmul(torch.randn(2, 64).half(), torch.zeros(128, dtype=torch.int32),
                               torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, 16).half(),
                               torch.zeros(64, dtype=torch.int32)), "qweight"),
    "gptq: float64 scales": (
        lambda *_: gptq_matmul(torch.randn(2, 64).half(), torch.zeros(8, 16, dtype=torch.int32),
                               torch.zeros(1, 2, dtype=torch.int32),
                               torch.ones(1, 16).double(), torch.zeros(64, dtype=torch.int32)),
        "scales"),
    "gptq: g_idx names a group that has no scales": (
        lambda *_: gptq_matmul(torch.randn(2, 64).half(), torch.zeros(8, 16, dtype=torch.int32),
                               torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, 16).half(),
                               torch.full((64,), 3, dtype=torch.int32)), "g_idx"),
    "gptq: N not a multiple of 8": (
        lambda *_: gptq_matmul(torch.randn(2, 64).half(), torch.zeros(8, 12, dtype=torch.int32),
                               torch.zeros(1, 2, dtype=torch.int32), torch.ones(1, 12).half(),
                               torch.zeros(64, dtype=torch.int32)), "multiple of 8"),
    "awq: scales not a multiple of 8 columns": (
        lambda *_: awq_matmul(torch.randn(2, 64).half(), torch.zeros(64, 2, dtype=torch.int32),
                              torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 12).half(), 32),
        "scales"),
    "awq: float64 scales": (
        lambda *_: awq_matmul(torch.randn(2, 64).half(), torch.zeros(64, 2, dtype=torch.int32),
                              torch.zeros(2, 2, dtype=torch.int32), torch.ones(2, 16).double(),
                              32), "scales"),
    "w8a16: float64 scales": (
        lambda *_: w8a16_matmul(torch.randn(2, 64).half(), torch.zeros(16, 64, dtype=torch.int8),
                                torch.ones(16).double()), "scales"),
    "nf4: integer output dtype": (
        lambda *_: nf4_dequantize(torch.zeros(32, dtype=torch.uint8), torch.ones(1), 64, (64,),
                                  torch.int32), "dtype"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_input_raises_value_error(name):
    fn, match = BAD[name]
    with pytest.raises(ValueError, match=match):
        fn(*_attn_inputs())


def test_fuzz_covers_the_shape_space():
    """The seeded draws really include what the module docstring promises."""
    dec = [_decode_case(s) for s in DECODE_SEEDS]
    assert {c[0] for c in dec} == set(HEAD_DIMS)
    assert {c[1] // c[2] for c in dec} == set(GQA)
    assert {c[3] for c in dec} == set(BLOCK_SIZES) and {c[4] for c in dec} == set(DTYPES)
    lens = [(n, c[3]) for c in dec for n in c[5]]
    assert {n - bs for n, bs in lens if abs(n - bs) <= 1} == {-1, 0, 1}
    assert any(n == 1 for n, _ in lens) and any(len(set(c[5])) > 1 for c in dec)
    assert any(c[6] is not None and c[6] > math.ceil(max(c[5]) / c[3]) for c in dec)
    pre = [_prefill_case(s) for s in PREFILL_SEEDS]
    pairs = [(n, ql) for c in pre for n, ql in zip(c[5], c[6])]
    assert any(ql == n for n, ql in pairs) and any(0 < ql < n for n, ql in pairs)
    assert any(ql > 16 for _, ql in pairs)  # the 64-row query tile
    kinds = {_gptq_case(s)[4] for s in range(24)}
    assert kinds == {"group", "act_order", "per_channel", "ragged"}

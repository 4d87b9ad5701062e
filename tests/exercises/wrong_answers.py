"""Deliberately wrong solutions: negative controls proving each checker catches real mistakes.

Each is a mistake learners (and interview candidates) actually make. The test suite runs every
checker on these and asserts it fails with a message that points at the mistake. Triton ones
live in ``wrong_kernels``.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from labkit.exercises import solutions as ref
from labkit.exercises.shared import Seq
from labkit.quant.nf4 import NF4_CODE


# ---- KV-cache size ------------------------------------------------------------------------------
def kv_bytes_uses_query_heads(num_layers: int, num_attention_heads: int, num_kv_heads: int,
                              head_dim: int, seq_len: int, batch_size: int,
                              dtype: torch.dtype) -> int:
    """Ignores GQA: caches every query head."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_attention_heads * head_dim * seq_len * batch_size * elem


def kv_bytes_forgets_v(num_layers: int, num_attention_heads: int, num_kv_heads: int,
                       head_dim: int, seq_len: int, batch_size: int, dtype: torch.dtype) -> int:
    """Counts K only."""
    elem = torch.empty((), dtype=dtype).element_size()
    return num_layers * num_kv_heads * head_dim * seq_len * batch_size * elem


def kv_bytes_assumes_fp16(num_layers: int, num_attention_heads: int, num_kv_heads: int,
                          head_dim: int, seq_len: int, batch_size: int, dtype: torch.dtype) -> int:
    """Hard-codes 2 bytes per element."""
    return 2 * num_layers * num_kv_heads * head_dim * seq_len * batch_size * 2


# ---- block allocator ----------------------------------------------------------------------------
class AllocatorNoRefDecrement(ref.BlockAllocator):
    """free() forgets shared blocks: only blocks with ref count 1 are released, others leak."""

    def free(self, seq_id: Any) -> None:
        for block in self.tables.pop(seq_id):
            if self.refs[block] == 1:
                self._drop(block)
        del self.num_tokens[seq_id]


class AllocatorOffByOne(ref.BlockAllocator):
    """Allocates num_tokens // block_size blocks (floor instead of ceil) — one short."""

    def allocate(self, seq_id: Any, num_tokens: int) -> list[int]:
        need = max(1, num_tokens // self.block_size)
        if need > len(self.free_list):
            raise MemoryError("no space")
        self.tables[seq_id] = [self._take() for _ in range(need)]
        self.num_tokens[seq_id] = num_tokens
        return list(self.tables[seq_id])


class AllocatorNoCopyOnWrite(ref.BlockAllocator):
    """Writes into shared partly filled blocks: forked samples overwrite each other's KV."""

    def append_token(self, seq_id: Any) -> tuple[int, int] | None:
        n = self.num_tokens[seq_id]
        if n % self.block_size == 0:
            if not self.free_list:
                raise MemoryError("no free block")
            self.tables[seq_id].append(self._take())
        self.num_tokens[seq_id] = n + 1
        return None


class AllocatorPartialOnOOM(ref.BlockAllocator):
    """Takes blocks one by one and raises mid-way, leaking the ones already taken."""

    def allocate(self, seq_id: Any, num_tokens: int) -> list[int]:
        need = -(-num_tokens // self.block_size)
        table = []
        for _ in range(need):
            if not self.free_list:
                raise MemoryError("no free block")
            table.append(self._take())
        self.tables[seq_id] = table
        self.num_tokens[seq_id] = num_tokens
        return list(table)


class AllocatorSwappedCowPair(ref.BlockAllocator):
    """Returns (dst, src): the engine would copy the empty new block over the shared one."""

    def append_token(self, seq_id: Any) -> tuple[int, int] | None:
        cow = super().append_token(seq_id)
        return None if cow is None else (cow[1], cow[0])


class AllocatorAllocateReturnsNothing(ref.BlockAllocator):
    """Sets up the table but forgets to return it."""

    def allocate(self, seq_id: Any, num_tokens: int) -> list[int]:
        super().allocate(seq_id, num_tokens)
        return None


# ---- prefix caching -----------------------------------------------------------------------------
def hashes_not_chained(token_ids: list[int], block_size: int, cache_salt: str | None = None
                       ) -> list:
    """Each block hashed on its own tokens: a block is reused after a DIFFERENT prefix."""
    return [hash((tuple(token_ids[s:s + block_size]), cache_salt))
            for s in range(0, len(token_ids) - block_size + 1, block_size)]


def hashes_ignore_salt(token_ids: list[int], block_size: int, cache_salt: str | None = None
                       ) -> list:
    """Tenants share cached blocks (and can time each other's prompts)."""
    return ref.block_hashes(token_ids, block_size, None)


def hashes_include_partial_block(token_ids: list[int], block_size: int,
                                 cache_salt: str | None = None) -> list:
    keys, parent = [], None
    for s in range(0, len(token_ids), block_size):
        parent = hash((parent, tuple(token_ids[s:s + block_size]), cache_salt))
        keys.append(parent)
    return keys


def lookup_skips_holes(hashes: list, num_tokens: int, block_size: int, cached: dict) -> list[int]:
    """Uses every cached block, even after a miss."""
    limit = (num_tokens - 1) // block_size
    return [cached[k] for k in hashes[:limit] if k in cached]


def lookup_reuses_everything(hashes: list, num_tokens: int, block_size: int,
                             cached: dict) -> list[int]:
    """Forgets that the last token must be computed to get logits."""
    out = []
    for k in hashes:
        if k not in cached:
            break
        out.append(cached[k])
    return out


# ---- scheduler step -----------------------------------------------------------------------------
def schedule_prefill_first(running: list[Seq], waiting: list[Seq], token_budget: int,
                           max_num_seqs: int) -> dict[str, int]:
    """Admits new prompts before running decodes: decodes stall behind long prefills."""
    plan: dict[str, int] = {}
    budget, n = token_budget, len(running)
    for seq in waiting:
        if budget == 0 or n >= max_num_seqs:
            break
        plan[seq.seq_id] = min(seq.num_prompt_tokens - seq.num_computed_tokens, budget)
        budget -= plan[seq.seq_id]
        n += 1
    for seq in running:
        left = max(1, seq.num_prompt_tokens - seq.num_computed_tokens)
        if budget > 0:
            plan[seq.seq_id] = min(left, budget)
            budget -= plan[seq.seq_id]
    return plan


def schedule_no_chunking(running: list[Seq], waiting: list[Seq], token_budget: int,
                         max_num_seqs: int) -> dict[str, int]:
    """Admits a waiting prompt only when all of it fits: the budget is left unused."""
    plan = ref.schedule_step(running, [], token_budget, max_num_seqs)
    budget, n = token_budget - sum(plan.values()), len(running)
    for seq in waiting:
        left = seq.num_prompt_tokens - seq.num_computed_tokens
        if left > budget or n >= max_num_seqs:
            break
        plan[seq.seq_id] = left
        budget -= left
        n += 1
    return plan


def schedule_max_seqs_off_by_one(running: list[Seq], waiting: list[Seq], token_budget: int,
                                 max_num_seqs: int) -> dict[str, int]:
    """Lets max_num_seqs + 1 sequences run."""
    return ref.schedule_step(running, waiting, token_budget, max_num_seqs + 1)


# ---- latency metrics ----------------------------------------------------------------------------
def latency_tpot_divides_by_n(requests: list[dict]) -> dict:
    out = ref.latency_metrics(requests)
    tpot = [(r["token_times"][-1] - r["token_times"][0]) / len(r["token_times"])
            for r in requests if len(r["token_times"]) >= 2]
    if tpot:
        out["tpot"] = ref._stats(tpot)
    return out


def latency_nearest_rank_p99(requests: list[dict]) -> dict:
    out = ref.latency_metrics(requests)
    v = sorted(r["first_token_time"] - r["arrival_time"] for r in requests)
    out["ttft"]["p99"] = v[min(len(v) - 1, int(0.99 * len(v)))]
    return out


def latency_ttft_from_scheduling(requests: list[dict]) -> dict:
    """Measures TTFT from first scheduling: hides the queueing delay users feel."""
    fixed = [dict(r, arrival_time=r.get("first_scheduled_time", r["arrival_time"]))
             for r in requests]
    out = ref.latency_metrics(fixed)
    out["e2e"] = ref.latency_metrics(requests)["e2e"]
    return out


def latency_tpot_zero_for_single_token(requests: list[dict]) -> dict:
    """Counts a single-token request's TPOT as 0 instead of leaving it out."""
    out = ref.latency_metrics(requests)
    tpot = [(r["token_times"][-1] - r["token_times"][0]) / max(len(r["token_times"]) - 1, 1)
            for r in requests]
    out["tpot"] = ref._stats(tpot)
    return out


# ---- quantization -------------------------------------------------------------------------------
def int8_scale_128(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.float().abs().amax(dim=1) / 128).clamp(min=1e-8)
    return torch.round(w / scale[:, None]).clamp(-128, 127).to(torch.int8), scale


def int8_per_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.float().abs().max() / 127).clamp(min=1e-8).expand(w.shape[0]).clone()
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def int8_truncates(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.float().abs().amax(dim=1) / 127).clamp(min=1e-8)
    return torch.trunc(w / scale[:, None]).to(torch.int8), scale


def int4_range_without_zero(w: torch.Tensor, group_size: int):
    """min/max of the group only: an all-positive group cannot represent 0."""
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    lo, hi = g.amin(dim=2), g.amax(dim=2)
    scale = ((hi - lo) / 15).clamp(min=1e-8)
    zero = torch.round(-lo / scale).clamp(0, 15)
    codes = torch.clamp(torch.round(g / scale[..., None]) + zero[..., None], 0, 15)
    return codes.reshape(n, k).to(torch.uint8), scale, zero


def int4_no_clamp(w: torch.Tensor, group_size: int):
    """Codes are not clamped: an outlier wraps around when stored in 4 bits."""
    codes, scale, zero = ref.quantize_int4_groupwise(w, group_size)
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    raw = torch.round(g / scale[..., None]) + zero[..., None] + 1  # also biased by one
    return (raw.reshape(n, k).to(torch.int64) % 16).to(torch.uint8), scale, zero


def dequantize_int4_wrong_group(codes, scales, zeros, group_size):
    """Indexes groups by row instead of column."""
    n, k = codes.shape
    s = scales.repeat_interleave(group_size, dim=1)[:, :k]
    z = zeros.repeat_interleave(group_size, dim=1)[:, :k]
    return (codes.float() - z.float()) * s.flip(0)


def nf4_dequantize_wrong_block(codes, absmax, blocksize, shape):
    """Uses element i // (blocksize * 2) — the packed-byte index, not the element index."""
    idx = (torch.arange(codes.numel()) // (blocksize * 2)).clamp(max=absmax.numel() - 1)
    return (NF4_CODE[codes.long()] * absmax[idx]).reshape(shape)


def nf4_quantize_floor(w: torch.Tensor, blocksize: int):
    """Picks the level just below instead of the nearest."""
    blocks = w.float().reshape(-1, blocksize)
    absmax = blocks.abs().amax(dim=1)
    x = (blocks / absmax.clamp(min=1e-12)[:, None]).reshape(-1)
    codes = (torch.bucketize(x, NF4_CODE, right=True) - 1).clamp(0, 15)
    return codes.to(torch.uint8), absmax


def nf4_codes_int64(w: torch.Tensor, blocksize: int):
    """Right codes, but left as argmin's int64: 8 bytes per 4-bit code."""
    codes, absmax = ref.nf4_quantize(w, blocksize)
    return codes.long(), absmax


# ---- speculative decoding -----------------------------------------------------------------------
def accept_if_p_greater(p, q, draft_token, generator):
    """Deterministic: accept iff p(x) >= q(x), else sample the residual."""
    if float(p[draft_token]) >= float(q[draft_token]):
        return True, draft_token
    residual = (p - q).clamp(min=0)
    return False, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))


def resample_from_p(p, q, draft_token, generator):
    """Right acceptance test, but on rejection samples p instead of the residual."""
    u = float(torch.rand(1, generator=generator))
    if u * float(q[draft_token]) < float(p[draft_token]):
        return True, draft_token
    return False, int(torch.multinomial(p, 1, generator=generator))


def resample_from_q(p, q, draft_token, generator):
    u = float(torch.rand(1, generator=generator))
    if u * float(q[draft_token]) < float(p[draft_token]):
        return True, draft_token
    return False, int(torch.multinomial(q, 1, generator=generator))


def tokens_per_step_exponent_gamma(alpha: float, gamma: int) -> float:
    if alpha == 1.0:
        return float(gamma)
    return (1 - alpha ** gamma) / (1 - alpha)


def tokens_per_step_no_alpha_one(alpha: float, gamma: int) -> float:
    return (1 - alpha ** (gamma + 1)) / (1 - alpha) if alpha != 1.0 else math.nan


def speedup_forgets_target(alpha: float, gamma: int, c: float) -> float:
    return ref.expected_tokens_per_step(alpha, gamma) / max(gamma * c, 1e-9)


def accept_top_token_without_coin(p, q, draft_token, generator):
    """Shortcut: the target's most likely token is always accepted, no coin flip."""
    if draft_token == int(p.argmax()):
        return True, draft_token
    return ref.accept_or_resample(p, q, draft_token, generator)


def accept_inverted_ratio(p, q, draft_token, generator):
    """Accepts with probability min(1, q/p) instead of min(1, p/q)."""
    u = float(torch.rand(1, generator=generator))
    if u * float(p[draft_token]) < float(q[draft_token]):
        return True, draft_token
    residual = (p - q).clamp(min=0)
    return False, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))


def accept_global_rng(p, q, draft_token, generator):
    """The right rule, but u comes from the global RNG: not reproducible from the seed."""
    u = float(torch.rand(1))
    if u * float(q[draft_token]) < float(p[draft_token]):
        return True, draft_token
    residual = (p - q).clamp(min=0)
    return False, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))

"""Reference solutions of every exercise. Spoilers: try the exercise first.

Notebooks never import this module unless ``LABKIT_INJECT_SOLUTIONS=1`` (CI does that, so the
notebooks are executed against these and cannot rot). The test suite checks each one passes its
checker. Triton kernels live in ``labkit.exercises.triton_solutions`` and are re-exported lazily
here, because defining a ``@triton.jit`` function needs the interpreter decided first.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from labkit.exercises.scheduler_step import Seq


# ---- 01 KV-cache size ---------------------------------------------------------------------------
def kv_cache_bytes(num_layers: int, num_attention_heads: int, num_kv_heads: int, head_dim: int,
                   seq_len: int, batch_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * seq_len * batch_size * elem


# ---- 02 block allocator -------------------------------------------------------------------------
class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.free_list = list(range(num_blocks))
        self.refs = [0] * num_blocks
        self.tables: dict[Any, list[int]] = {}
        self.num_tokens: dict[Any, int] = {}

    def _take(self) -> int:
        block = self.free_list.pop()
        self.refs[block] = 1
        return block

    def _drop(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free_list.append(block)

    def allocate(self, seq_id: Any, num_tokens: int) -> list[int]:
        need = -(-num_tokens // self.block_size)
        if need > len(self.free_list):
            raise MemoryError(f"need {need} blocks, {len(self.free_list)} free")
        self.tables[seq_id] = [self._take() for _ in range(need)]
        self.num_tokens[seq_id] = num_tokens
        return list(self.tables[seq_id])

    def append_token(self, seq_id: Any) -> tuple[int, int] | None:
        table, n = self.tables[seq_id], self.num_tokens[seq_id]
        if n % self.block_size == 0:  # last block full (or no block yet)
            if not self.free_list:
                raise MemoryError("no free block")
            table.append(self._take())
            self.num_tokens[seq_id] = n + 1
            return None
        last = table[-1]
        cow = None
        if self.refs[last] > 1:  # shared and partly filled: copy before writing
            if not self.free_list:
                raise MemoryError("no free block for copy-on-write")
            table[-1] = self._take()
            self._drop(last)
            cow = (last, table[-1])
        self.num_tokens[seq_id] = n + 1
        return cow

    def fork(self, parent_id: Any, child_id: Any) -> None:
        self.tables[child_id] = list(self.tables[parent_id])
        self.num_tokens[child_id] = self.num_tokens[parent_id]
        for block in self.tables[child_id]:
            self.refs[block] += 1

    def free(self, seq_id: Any) -> None:
        for block in reversed(self.tables.pop(seq_id)):
            self._drop(block)
        del self.num_tokens[seq_id]

    def block_table(self, seq_id: Any) -> list[int]:
        return list(self.tables[seq_id])

    def ref_count(self, block_id: int) -> int:
        return self.refs[block_id]

    def num_free_blocks(self) -> int:
        return len(self.free_list)


# ---- 03 prefix caching --------------------------------------------------------------------------
def block_hashes(token_ids: list[int], block_size: int, cache_salt: str | None = None) -> list:
    import hashlib

    keys: list = []
    parent = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start:start + block_size]
        payload = repr((parent, tuple(block), cache_salt)).encode()
        parent = hashlib.sha256(payload).digest()
        keys.append(parent)
    return keys


def longest_cached_prefix(hashes: list, num_tokens: int, block_size: int,
                          cached: dict) -> list[int]:
    limit = (num_tokens - 1) // block_size  # keep >= 1 token to compute
    blocks: list[int] = []
    for key in hashes[:limit]:
        if key not in cached:
            break
        blocks.append(cached[key])
    return blocks


# ---- 04 scheduler step --------------------------------------------------------------------------
def schedule_step(running: list[Seq], waiting: list[Seq], token_budget: int,
                  max_num_seqs: int) -> dict[str, int]:
    plan: dict[str, int] = {}
    budget = token_budget
    for seq in running:  # decode first: one token each
        if seq.num_computed_tokens >= seq.num_prompt_tokens and budget > 0:
            plan[seq.seq_id] = 1
            budget -= 1
    for seq in running:  # then running prefills (chunked)
        left = seq.num_prompt_tokens - seq.num_computed_tokens
        if left > 0 and budget > 0:
            plan[seq.seq_id] = min(left, budget)
            budget -= plan[seq.seq_id]
    num_seqs = len(running)
    for seq in waiting:  # then admit in arrival order
        if budget == 0 or num_seqs >= max_num_seqs:
            break
        plan[seq.seq_id] = min(seq.num_prompt_tokens - seq.num_computed_tokens, budget)
        budget -= plan[seq.seq_id]
        num_seqs += 1
    return plan


# ---- 05 latency metrics -------------------------------------------------------------------------
def _stats(values: list[float]) -> dict[str, float]:
    t = torch.tensor(values, dtype=torch.float64)
    return {"mean": float(t.mean()), "p50": float(torch.quantile(t, 0.5)),
            "p99": float(torch.quantile(t, 0.99))}


def latency_metrics(requests: list[dict]) -> dict[str, dict[str, float]]:
    ttft = [r["first_token_time"] - r["arrival_time"] for r in requests]
    e2e = [r["finish_time"] - r["arrival_time"] for r in requests]
    tpot = [(r["token_times"][-1] - r["token_times"][0]) / (len(r["token_times"]) - 1)
            for r in requests if len(r["token_times"]) >= 2]
    out = {"ttft": _stats(ttft), "e2e": _stats(e2e)}
    out["tpot"] = _stats(tpot) if tpot else {"mean": math.nan, "p50": math.nan, "p99": math.nan}
    return out


# ---- 06 quantization ----------------------------------------------------------------------------
def quantize_int8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (w.float().abs().amax(dim=1) / 127).clamp(min=1e-8)
    q = torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[:, None]


def quantize_int4_groupwise(w: torch.Tensor, group_size: int
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    n, k = w.shape
    g = w.float().reshape(n, k // group_size, group_size)
    wmin = g.amin(dim=2).clamp(max=0)
    wmax = g.amax(dim=2).clamp(min=0)
    scale = (wmax - wmin) / 15
    scale = torch.where(scale == 0, torch.ones_like(scale), scale)
    zero = torch.round(-wmin / scale).clamp(0, 15)
    codes = torch.clamp(torch.round(g / scale[..., None]) + zero[..., None], 0, 15)
    return codes.reshape(n, k).to(torch.uint8), scale, zero


def dequantize_int4_groupwise(codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                              group_size: int) -> torch.Tensor:
    n, k = codes.shape
    g = codes.float().reshape(n, k // group_size, group_size)
    return ((g - zeros[..., None].float()) * scales[..., None].float()).reshape(n, k)


def nf4_quantize(w: torch.Tensor, blocksize: int) -> tuple[torch.Tensor, torch.Tensor]:
    from labkit.exercises.quantization import NF4_CODE

    blocks = w.float().reshape(-1, blocksize)
    absmax = blocks.abs().amax(dim=1)
    x = blocks / absmax.clamp(min=1e-12)[:, None]
    codes = (x[..., None] - NF4_CODE).abs().argmin(dim=-1)
    return codes.reshape(-1).to(torch.uint8), absmax


def nf4_dequantize(codes: torch.Tensor, absmax: torch.Tensor, blocksize: int,
                   shape: tuple[int, ...]) -> torch.Tensor:
    from labkit.exercises.quantization import NF4_CODE

    values = NF4_CODE[codes.long()].reshape(-1, blocksize) * absmax[:, None]
    return values.reshape(shape)


# ---- 07 speculative decoding --------------------------------------------------------------------
def accept_or_resample(p: torch.Tensor, q: torch.Tensor, draft_token: int,
                       generator: torch.Generator) -> tuple[bool, int]:
    u = float(torch.rand(1, generator=generator))
    if u * float(q[draft_token]) < float(p[draft_token]):  # u < p/q without dividing
        return True, draft_token
    residual = (p - q).clamp(min=0)
    return False, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))


def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    if alpha == 1.0:
        return gamma + 1.0
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def expected_speedup(alpha: float, gamma: int, c: float) -> float:
    return expected_tokens_per_step(alpha, gamma) / (gamma * c + 1)


# ---- 08 Triton kernels (lazy) -------------------------------------------------------------------
_TRITON = ("add_kernel", "paged_attention_kernel")


def __getattr__(name: str) -> Any:
    if name in _TRITON:
        from labkit.exercises import triton_solutions

        return getattr(triton_solutions, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""Reference solutions of every exercise. Spoilers: try the exercise first.

Only ``labkit.exercises.inject`` reads this module, and only under ``LABKIT_INJECT_SOLUTIONS=1``
(CI does that, so the notebooks are executed against these and cannot rot); the checkers take
their references from labkit itself. Where labkit has no implementation of the exercise's exact
contract (the allocator, the scheduler step, the prefix lookup), the checker's own reference IS
the solution and is re-exported here. The Triton kernels live in ``triton_solutions`` and are
loaded on first use, after the interpreter is chosen.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch

from labkit.exercises.allocator import ReferenceAllocator
from labkit.exercises.prefix_cache import reference_longest_cached_prefix
from labkit.exercises.scheduler_step import reference_schedule_step
from labkit.exercises.triton_kernels import ensure_interpreter
from labkit.quant.nf4 import NF4_CODE


# ---- 01 KV-cache size ---------------------------------------------------------------------------
def kv_cache_bytes(num_layers: int, num_attention_heads: int, num_kv_heads: int, head_dim: int,
                   seq_len: int, batch_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * num_kv_heads * head_dim * seq_len * batch_size * elem


# ---- 02 block allocator: the checker's reference ----------------------------------------------
BlockAllocator = ReferenceAllocator


# ---- 03 prefix caching --------------------------------------------------------------------------
def block_hashes(token_ids: list[int], block_size: int, cache_salt: str | None = None) -> list:
    keys: list = []
    parent = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start:start + block_size]
        payload = repr((parent, tuple(block), cache_salt)).encode()
        parent = hashlib.sha256(payload).digest()
        keys.append(parent)
    return keys


longest_cached_prefix = reference_longest_cached_prefix


# ---- 04 scheduler step --------------------------------------------------------------------------
schedule_step = reference_schedule_step


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
    blocks = w.float().reshape(-1, blocksize)
    absmax = blocks.abs().amax(dim=1)
    x = blocks / absmax.clamp(min=1e-12)[:, None]
    codes = (x[..., None] - NF4_CODE).abs().argmin(dim=-1)
    return codes.reshape(-1).to(torch.uint8), absmax


def nf4_dequantize(codes: torch.Tensor, absmax: torch.Tensor, blocksize: int,
                   shape: tuple[int, ...]) -> torch.Tensor:
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
        ensure_interpreter()  # before the @triton.jit decorators of triton_solutions run
        from labkit.exercises import triton_solutions

        return getattr(triton_solutions, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

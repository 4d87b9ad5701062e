"""Small helpers the kernels share: interpreter detection and shape checks."""

from __future__ import annotations

import os

import torch
import triton.language as tl


def interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (``TRITON_INTERPRET=1``).

    The interpreter evaluates ``tl.dot`` on bf16 operands wrongly (triton 3.9), so kernels take a
    ``DOT_FP32`` flag from this and upcast their dot operands to fp32 there. On a GPU the flag is
    off and the tensor cores see bf16/fp16 operands with fp32 accumulation.
    """
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (``tl.arange`` sizes must be powers of two)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands on a GPU default to tf32 in ``tl.dot``; ask for full fp32 instead."""
    return "ieee" if dtype == torch.float32 else "tf32"


def torch_to_tl(dtype: torch.dtype) -> tl.dtype:
    return {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}[
        dtype
    ]


def check(cond: bool, msg: str) -> None:
    """Raise ValueError(msg) unless cond: kernels read raw pointers, bad shapes stop here."""
    if not cond:
        raise ValueError(msg)


FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def check_dtype(t: torch.Tensor, name: str, allowed: tuple[torch.dtype, ...]) -> None:
    """ValueError unless ``t.dtype`` is in ``allowed`` (the dtypes the kernels compile for)."""
    names = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32",
             torch.int32: "int32", torch.int64: "int64"}
    want = ", ".join(names.get(d, str(d)) for d in allowed[:-1])
    want = f"{want} or {names.get(allowed[-1], str(allowed[-1]))}" if want else names[allowed[0]]
    check(t.dtype in allowed, f"{name} must be {want}, got {t.dtype}")


def on_host(*tensors: torch.Tensor) -> bool:
    """True when all tensors are CPU tensors (the interpreter): then value checks (lengths that
    fit their block tables, slots inside the cache) cost no device sync, and an out-of-range
    value would make the interpreter read or write outside a buffer. On a GPU they would cost a
    sync per call, so there the caller (the engine's block manager) guarantees them, as in vLLM."""
    return all(t.device.type == "cpu" for t in tensors)

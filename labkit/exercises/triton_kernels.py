"""Exercises: Triton kernels — a vector-add warm-up, then paged-attention decode for one head.

Without a GPU, Triton runs kernels through its interpreter (numpy on the CPU) when
``TRITON_INTERPRET=1`` is set *before the kernel is defined* (``@triton.jit`` decides then).
``ensure_interpreter()`` sets it when there is no GPU: the notebook's first cell calls it.

A real GPU does not tell you that a thread read past the end of a tensor: you get garbage or, much
later, an illegal-address crash. Here every access is checked: each tensor handed to your kernel
sits between guard zones, and the interpreter's load/store is wrapped so that an unmasked access
outside every tensor is reported with the tensor it ran past and by how many elements.
"""

from __future__ import annotations

import contextlib
import os
import random
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from labkit.exercises.checks import CheckFailure, run_check
from labkit.kv.attention import get_attention_backend


def ensure_interpreter() -> bool:
    """Select Triton's CPU interpreter when there is no GPU; returns whether it is active.

    Call it before defining any ``@triton.jit`` kernel: the decorator reads ``TRITON_INTERPRET``
    when it runs, and a kernel defined without it is compiled for a GPU that is not there."""
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    return interpreted()


def interpreted() -> bool:
    """Whether kernels defined from now on run through the CPU interpreter."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def device() -> str:
    """Where the checkers put the tensors they hand your kernels."""
    return "cpu" if interpreted() or not torch.cuda.is_available() else "cuda"


# ---- guarded buffers and the bounds checker -----------------------------------------------------
GUARD = 64  # elements of guard zone on each side of every tensor
OUT_FILL = -12345.5  # outputs' guards: finite, so even a stored NaN shows up as a change


def guarded(t: torch.Tensor, fill: float = float("nan")) -> torch.Tensor:
    """A copy of ``t`` living inside a bigger buffer whose margins hold ``fill``."""
    flat = t.contiguous().reshape(-1)
    buf = torch.full((flat.numel() + 2 * GUARD,), fill, dtype=t.dtype, device=t.device) \
        if t.is_floating_point() else torch.full((flat.numel() + 2 * GUARD,), -7777,
                                                 dtype=t.dtype, device=t.device)
    buf[GUARD:GUARD + flat.numel()] = flat
    return buf[GUARD:GUARD + flat.numel()].view(t.shape)


class OutOfBounds(Exception):
    pass


@contextlib.contextmanager
def bounds_checked(tensors: dict[str, torch.Tensor], enabled: bool = True) -> Iterator[None]:
    """Raise OutOfBounds on any unmasked interpreter load/store outside ``tensors``."""
    if not interpreted() or not enabled:
        yield
        return
    import numpy as np
    from triton.runtime import interpreter as interp

    ranges = [(name, t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), t.element_size(),
               t.numel()) for name, t in tensors.items()]
    starts = np.array([r[1] for r in ranges], dtype=np.uint64)
    ends = np.array([r[2] for r in ranges], dtype=np.uint64)
    builder = interp.InterpreterBuilder
    orig_load, orig_store = builder.create_masked_load, builder.create_masked_store

    def check(kind: str, ptrs: Any, mask: Any) -> None:
        addr = np.asarray(ptrs.data, dtype=np.uint64).reshape(-1)
        m = np.broadcast_to(np.asarray(mask.data, dtype=bool), np.shape(ptrs.data)).reshape(-1)
        addr = addr[m]
        if addr.size == 0:
            return
        inside = ((addr[:, None] >= starts[None, :]) & (addr[:, None] < ends[None, :])).any(1)
        if inside.all():
            return
        bad = addr[~inside]
        a = int(bad[0])
        # name the tensor the pointer most likely came from: the closest start below it
        below = [r for r in ranges if r[1] <= a]
        name, start, _, size, numel = max(below, key=lambda r: r[1]) if below else \
            min(ranges, key=lambda r: r[1])
        offset = (a - start) // size if a >= start else -((start - a) // size)
        raise OutOfBounds(f"{kind} at {name} + {offset} (element offset) but {name} has "
                          f"{numel} elements (valid offsets 0..{numel - 1}); {bad.size} "
                          f"out-of-bounds lane(s) in this access")

    def load(self: Any, ptrs: Any, mask: Any, other: Any, *args: Any) -> Any:
        check("load", ptrs, mask)
        return orig_load(self, ptrs, mask, other, *args)

    def store(self: Any, ptrs: Any, value: Any, mask: Any, *args: Any) -> Any:
        check("store", ptrs, mask)
        return orig_store(self, ptrs, value, mask, *args)

    builder.create_masked_load, builder.create_masked_store = load, store
    try:
        yield
    finally:
        builder.create_masked_load, builder.create_masked_store = orig_load, orig_store


def _guard_zones(t: torch.Tensor) -> dict[str, torch.Tensor] | None:
    base = t._base
    if base is None or base.numel() != t.numel() + 2 * GUARD:
        return None
    return {"before the start": base[:GUARD], "past the end": base[GUARD + t.numel():]}


def _snapshot(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    return {name: {k: z.clone() for k, z in zones.items()}
            for name, t in tensors.items() if (zones := _guard_zones(t)) is not None}


def _check_guards(tensors: dict[str, torch.Tensor], before: dict, what: str) -> None:
    """A write past either end lands in a guard zone: the only OOB a real GPU lets us see."""
    for name, zones in before.items():
        for side, old in zones.items():
            now = _guard_zones(tensors[name])[side]
            same = (now == old) | (torch.isnan(now) & torch.isnan(old)) \
                if now.is_floating_point() else now == old
            if not bool(same.all()):
                raise CheckFailure(f"out-of-bounds access: your kernel wrote {side} of {name}",
                                   inputs=what, show_values=False,
                                   hint="mask every tl.store whose offsets can run past the end "
                                        "(mask=offsets < n).")


def _find_oob(e: BaseException) -> str | None:
    """The interpreter wraps exceptions raised inside a kernel; dig ours out."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OutOfBounds):
            return str(e)
        text = str(e)
        if "OutOfBounds(" in text:
            start = text.index("OutOfBounds(") + len("OutOfBounds(")
            return text[start:].rstrip(")").strip("'\"")
        e = e.__cause__ or e.__context__
    return None


def _launch(kernel: Any, grid: tuple, tensors: dict[str, torch.Tensor], args: list,
            meta: dict, what: str, check_bounds: bool = True) -> None:
    if device() == "cpu" and type(kernel).__name__ == "JITFunction":
        raise CheckFailure(
            "your kernel was compiled for a GPU, but there is none", show_values=False,
            hint="call labkit.exercises.triton_kernels.ensure_interpreter() BEFORE defining "
                 "the @triton.jit kernel (the notebook's first cell does), then run the kernel's "
                 "cell again.")
    if not hasattr(kernel, "__getitem__"):
        raise CheckFailure("expected a @triton.jit function", expected="a triton kernel",
                           actual=kernel, hint="decorate your kernel with @triton.jit.")
    try:
        before = _snapshot(tensors)
        with bounds_checked(tensors, enabled=check_bounds), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # numpy NaN noise from the interpreter
            kernel[grid](*args, **meta)
        if device() != "cpu":
            torch.cuda.synchronize()
        _check_guards(tensors, before, what)
    except CheckFailure:
        raise
    except Exception as e:  # noqa: BLE001 - compile or launch errors in learner code
        oob = _find_oob(e)
        if oob is not None:
            raise CheckFailure(f"out-of-bounds access: {oob}", inputs=what, show_values=False,
                               hint="mask every tl.load / tl.store whose offsets can run past "
                                    "the end (mask=offsets < n), or clamp the offsets.") from None
        msg = str(e).strip().splitlines()
        raise CheckFailure(f"launching your kernel failed: {type(e).__name__}: "
                           f"{' '.join(msg[-3:]) if msg else ''}", inputs=what,
                           show_values=False,
                           hint="read the error: Triton names the line of the kernel.") from e


def _untouched(out: torch.Tensor, name: str) -> None:
    """A kernel that stored nothing is a stub, not a wrong answer: say so, not "wrong sum"."""
    if bool((out == 0).all()):
        raise NotImplementedError(f"your kernel stored nothing to {name}: write its body where "
                                  "the cell says `# your code here`")


# ---- vector add ---------------------------------------------------------------------------------
def check_vector_add(add_kernel: Any) -> object:
    def body() -> str:
        g = torch.Generator().manual_seed(0)
        for n, block in [(1024, 256), (100, 64), (1, 128), (4097, 1024)]:
            x = guarded(torch.randn(n, generator=g).to(device()))
            y = guarded(torch.randn(n, generator=g).to(device()))
            out = guarded(torch.zeros(n, device=device()), fill=OUT_FILL)
            grid = ((n + block - 1) // block,)
            what = f"n_elements={n}, BLOCK_SIZE={block}, grid={grid}"
            _launch(add_kernel, grid, {"x_ptr": x, "y_ptr": y, "out_ptr": out},
                    [x, y, out, n], {"BLOCK_SIZE": block}, what)
            _untouched(out, "out_ptr")
            expected = x + y
            if not torch.allclose(out, expected):
                i = int((~torch.isclose(out, expected)).nonzero()[0])
                raise CheckFailure(f"wrong sum at element {i}", inputs=what,
                                   expected=float(expected[i]), actual=float(out[i]),
                                   hint="offsets = pid * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE); "
                                        "every program must cover its own slice.")
        return "correct on 4 sizes, every access in bounds. On to paged attention!"

    return run_check("triton_vector_add", body)


# ---- paged attention decode, one head -----------------------------------------------------------
def reference_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     block_tables: torch.Tensor, context_lens: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """Gather each sequence's K/V through its block table, then plain softmax attention."""
    bs = k_cache.shape[1]
    out = torch.empty_like(q, dtype=torch.float32)
    for s in range(q.shape[0]):
        n = int(context_lens[s])
        blocks = block_tables[s, : (n + bs - 1) // bs].long()
        k = k_cache[blocks].reshape(-1, k_cache.shape[-1])[:n].float()
        v = v_cache[blocks].reshape(-1, v_cache.shape[-1])[:n].float()
        out[s] = torch.softmax(scale * (k @ q[s].float()), dim=0) @ v
    return out


def _paged_case(seed: int, context_lens: list[int], block_size: int, head_dim: int,
                shuffle: bool) -> dict[str, Any]:
    g = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_seqs = len(context_lens)
    max_blocks = max((n + block_size - 1) // block_size for n in context_lens) + 1
    num_blocks = num_seqs * max_blocks + 3
    physical = list(range(num_blocks))
    if shuffle:
        rng.shuffle(physical)
    tables = torch.zeros(num_seqs, max_blocks, dtype=torch.int32)
    # unused blocks hold finite garbage; only slots past a context (in used blocks) hold NaN,
    # so a NaN output means exactly "read past context_len"
    k_cache = torch.randn(num_blocks, block_size, head_dim, generator=g) * 3
    v_cache = torch.randn(num_blocks, block_size, head_dim, generator=g) * 3
    it = iter(physical)
    for s, n in enumerate(context_lens):
        for i in range((n + block_size - 1) // block_size):
            b = next(it)
            tables[s, i] = b
            filled = min(block_size, n - i * block_size)
            k_cache[b, filled:] = float("nan")
            v_cache[b, filled:] = float("nan")
    q = torch.randn(num_seqs, head_dim, generator=g)
    return {"q": q, "k_cache": k_cache, "v_cache": v_cache, "block_tables": tables,
            "context_lens": torch.tensor(context_lens, dtype=torch.int32),
            "scale": head_dim ** -0.5, "max_blocks": max_blocks}


PAGED_CASES = [  # (seed, context_lens, block_size, head_dim, shuffled block tables)
    (0, [3], 4, 16, False),
    (1, [4, 8], 4, 16, False),
    (2, [5, 8, 13], 4, 16, True),
    (3, [1, 17, 33, 40], 16, 32, True),
]


def check_paged_attention(paged_attention_kernel: Any) -> object:
    def body() -> str:
        for seed, lens, bs, d, shuffle in PAGED_CASES:
            c = _paged_case(seed, lens, bs, d, shuffle)
            t = {k: guarded(v.to(device())) for k, v in c.items()
                 if isinstance(v, torch.Tensor)}
            out = guarded(torch.zeros(len(lens), d, device=device()), fill=OUT_FILL)
            tensors = {"q_ptr": t["q"], "k_cache_ptr": t["k_cache"],
                       "v_cache_ptr": t["v_cache"], "block_tables_ptr": t["block_tables"],
                       "context_lens_ptr": t["context_lens"], "out_ptr": out}
            what = (f"context_lens={lens}, BLOCK_SIZE={bs}, HEAD_DIM={d}, block_tables="
                    f"{c['block_tables'].tolist()}")
            _launch(paged_attention_kernel, (len(lens),), tensors,
                    [*tensors.values(), c["scale"], c["max_blocks"]],
                    {"BLOCK_SIZE": bs, "HEAD_DIM": d}, what)
            _untouched(out, "out_ptr")
            expected = reference_decode(c["q"], c["k_cache"], c["v_cache"], c["block_tables"],
                                        c["context_lens"], c["scale"])
            _cross_check_backend(c, expected)
            got = out.float().cpu()
            for s, n in enumerate(lens):
                if torch.allclose(got[s], expected[s], atol=1e-4, rtol=1e-4):
                    continue
                if _ignores_table(c, got):
                    hint = ("sequences spanning several blocks read the wrong blocks: look up "
                            "the physical block with tl.load(block_tables_ptr + seq * "
                            "max_blocks_per_seq + i); logical block i is not physical block i.")
                elif torch.isnan(got[s]).any():
                    hint = ("NaN: you used K/V slots at positions >= context_len (the checker "
                            "fills them with NaN). Mask them: scores of invalid positions must be "
                            "-inf and their V loads masked (other=0).")
                elif torch.allclose(got[s], _no_rescale_decode(c, s), atol=1e-4, rtol=1e-4):
                    hint = ("right for one block, wrong across blocks: when a later block raises "
                            "the running max, rescale the running sum and the accumulator by "
                            "exp(m_old - m_new) before adding the new block.")
                else:
                    hint = ("compare with softmax(scale * K @ q) @ V; with an online softmax, "
                            "rescale the running sum and accumulator by exp(m_old - m_new) "
                            "when the max grows.")
                raise CheckFailure(f"wrong output for sequence {s} (context_len {n})",
                                   inputs=what, expected=expected[s], actual=got[s], hint=hint)
        return ("paged decode attention matches the reference through shuffled block tables, "
                "every access in bounds. This is the kernel vLLM's PagedAttention is built on.")

    return run_check("triton_paged_attention", body)


def _no_rescale_decode(c: dict[str, Any], s: int) -> torch.Tensor:
    """Sequence ``s`` through an online softmax that never rescales (the classic slip)."""
    bs = c["k_cache"].shape[1]
    n = int(c["context_lens"][s])
    m, denom, acc = float("-inf"), 0.0, torch.zeros(c["q"].shape[1])
    for i in range((n + bs - 1) // bs):
        b = int(c["block_tables"][s, i])
        valid = min(bs, n - i * bs)
        k, v = c["k_cache"][b, :valid].float(), c["v_cache"][b, :valid].float()
        scores = c["scale"] * (k @ c["q"][s].float())
        m = max(m, float(scores.max()))
        p = torch.exp(scores - m)
        denom, acc = denom + float(p.sum()), acc + p @ v
    return acc / denom


def _ignores_table(c: dict[str, Any], got: torch.Tensor) -> bool:
    """Does the output match attention over blocks s*max_blocks+i, i.e. no table lookup?"""
    num_seqs, max_blocks = c["block_tables"].shape
    naive = torch.arange(num_seqs * max_blocks, dtype=torch.int32).reshape(num_seqs, max_blocks)
    naive = naive.clamp(max=c["k_cache"].shape[0] - 1)
    with torch.no_grad():
        guess = reference_decode(c["q"], c["k_cache"], c["v_cache"], naive, c["context_lens"],
                                 c["scale"])
    return bool(torch.allclose(guess, got, atol=1e-4, rtol=1e-4, equal_nan=True))


def _cross_check_backend(c: dict[str, Any], expected: torch.Tensor) -> None:
    """Where labkit's torch attention backend exists, it must agree with this reference."""
    backend = get_attention_backend("torch")
    # NaN-free copies: labkit's backend multiplies masked probabilities (0) by the stale slots,
    # so it relies on stale KV being finite; the NaN canaries are this checker's own device
    k, v = torch.nan_to_num(c["k_cache"]), torch.nan_to_num(c["v_cache"])
    theirs = backend.decode(c["q"][:, None, :], k[:, :, None, :], v[:, :, None, :],
                            c["block_tables"], c["context_lens"], c["scale"])[:, 0, :]
    if not torch.allclose(theirs.float(), expected, atol=1e-4, rtol=1e-4):
        raise RuntimeError("labkit.kv.attention's torch decode disagrees with the exercise "
                           "reference: a labkit bug, please report it")


"""Exercise: a paged KV-cache block allocator with reference counts, fork and copy-on-write.

This is vLLM's block manager in miniature. Sequences own *block tables* (lists of physical block
ids); forked sequences (``n > 1`` samples, beam search) share blocks and bump their ref counts; a
write into a shared, partly filled block copies it first. The checker drives your class and the
reference with the same random operation sequences and compares everything observable — block
table lengths, which blocks are shared with which, ref counts, free counts, copy-on-write events,
out-of-memory behaviour — up to a renaming of physical block ids (any free block is a fine pick).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from labkit.exercises.checks import CheckFailure, run_check

CONTRACT = '''
class BlockAllocator:
    """Paged KV-cache blocks with reference counts.

    __init__(num_blocks, block_size): blocks 0..num_blocks-1 start free.
    allocate(seq_id, num_tokens) -> list[int]: a new sequence of num_tokens (>= 1) tokens takes
        ceil(num_tokens / block_size) free blocks (ref count 1 each) and returns its block table.
        Not enough free blocks -> raise MemoryError and change nothing.
    append_token(seq_id) -> tuple[int, int] | None: the sequence grows by one token.
        - last block full -> take a free block for the new token;
        - last block partly filled but shared (ref count > 1) -> copy-on-write: take a free block,
          put it in place of the shared one in this table, drop one ref from the shared one, and
          return (src, dst) so the engine copies the KV already written;
        - otherwise -> nothing to allocate. Returns None unless a copy-on-write happened.
        A block is needed but none is free -> raise MemoryError and change nothing.
    fork(parent_id, child_id): the child gets a copy of the parent's block table (same blocks,
        same token count); each of those blocks gains one reference.
    free(seq_id): the sequence ends; each of its blocks loses one reference; a block whose count
        reaches 0 becomes free again.
    block_table(seq_id) -> list[int];  ref_count(block_id) -> int (0 when free);
    num_free_blocks() -> int.
    """
'''


class _Mismatch(Exception):
    pass


def _random_ops(rng: random.Random, n_ops: int) -> list[tuple]:
    """Valid operation sequences (ids exist when used); out-of-memory is part of the game."""
    ops, live, next_id = [], [], 0
    for _ in range(n_ops):
        r = rng.random()
        if not live or r < 0.25:
            ops.append(("allocate", f"s{next_id}", rng.randint(1, 12)))
            live.append(f"s{next_id}")
            next_id += 1
        elif r < 0.6:
            ops.append(("append_token", rng.choice(live)))
        elif r < 0.8:
            ops.append(("fork", rng.choice(live), f"s{next_id}"))
            live.append(f"s{next_id}")
            next_id += 1
        else:
            sid = rng.choice(live)
            ops.append(("free", sid))
            live.remove(sid)
    return ops


def _fmt(op: tuple) -> str:
    return f"{op[0]}({', '.join(repr(a) for a in op[1:])})"


def _apply(alloc: Any, op: tuple) -> tuple[str, Any]:
    """Run one op; returns ("ok", value) or ("oom", None). Other exceptions propagate."""
    try:
        return "ok", getattr(alloc, op[0])(*op[1:])
    except MemoryError:
        return "oom", None


def _compare(mine: Any, ref: Any, live: list[str], num_blocks: int, last_op: tuple,
             out_mine: tuple, out_ref: tuple) -> None:
    if out_mine[0] != out_ref[0]:
        want = "raise MemoryError" if out_ref[0] == "oom" else "succeed"
        raise _Mismatch(f"{_fmt(last_op)} should {want}",
                        "MemoryError" if out_ref[0] == "oom" else "success",
                        "MemoryError" if out_mine[0] == "oom" else "success",
                        "count free blocks before taking any; a failed call must change nothing.")
    if last_op[0] == "append_token" and out_ref[0] == "ok":
        if (out_ref[1] is None) != (out_mine[1] is None):
            raise _Mismatch(f"{_fmt(last_op)} return value", out_ref[1], out_mine[1],
                            "return (src, dst) only for a copy-on-write: the token lands in a "
                            "partly filled block that another sequence also holds.")
    pairs: dict[int, int] = {}
    back: dict[int, int] = {}
    for sid in live:
        t_ref, t_mine = list(ref.block_table(sid)), list(mine.block_table(sid))
        if len(t_ref) != len(t_mine):
            raise _Mismatch(f"len(block_table({sid!r}))", len(t_ref), len(t_mine),
                            "a sequence of n tokens needs ceil(n / block_size) blocks; a new "
                            "block is needed only when the last one is full.")
        for i, (r, m) in enumerate(zip(t_ref, t_mine)):
            if not (isinstance(m, int) and 0 <= m < num_blocks):
                raise _Mismatch(f"block_table({sid!r})[{i}]", f"an id in [0, {num_blocks})", m,
                                "physical block ids are 0..num_blocks-1.")
            if pairs.setdefault(m, r) != r or back.setdefault(r, m) != m:
                raise _Mismatch(
                    f"sharing of block_table({sid!r})[{i}]", "a block shared exactly as in the "
                    "reference", f"block {m} is also used where the reference has a different "
                    "block", "only fork shares blocks; copy-on-write and fresh allocations must "
                    "take a block nobody else holds (is a freed block still in use?).")
    for m, r in pairs.items():
        if mine.ref_count(m) != ref.ref_count(r):
            raise _Mismatch(f"ref_count({m})", ref.ref_count(r), mine.ref_count(m),
                            "ref count = number of live block tables holding the block (fork adds "
                            "one per block, copy-on-write and free drop one).")
    if mine.num_free_blocks() != ref.num_free_blocks():
        raise _Mismatch("num_free_blocks()", ref.num_free_blocks(), mine.num_free_blocks(),
                        "a block returns to the free list exactly when its ref count reaches 0 "
                        "(and never twice).")


def check(allocator_cls: Callable[[int, int], Any], *, num_sequences: int = 60,
          ops_per_sequence: int = 40, seed: int = 0) -> object:
    """Random operation sequences against the reference; the first divergence is reported."""

    def body() -> str:
        from labkit.exercises.solutions import BlockAllocator as Reference

        rng = random.Random(seed)
        total_ops = 0
        cow = 0
        for _ in range(num_sequences):
            num_blocks, block_size = rng.choice([(4, 1), (8, 4), (16, 4), (12, 3), (32, 16)])
            ops = _random_ops(rng, ops_per_sequence)
            mine, ref = allocator_cls(num_blocks, block_size), Reference(num_blocks, block_size)
            live: list[str] = []
            history: list[str] = [f"BlockAllocator(num_blocks={num_blocks}, "
                                  f"block_size={block_size})"]
            for op in ops:
                if op[0] in ("append_token", "free") and op[1] not in live:
                    continue
                if op[0] == "fork" and op[1] not in live:
                    continue
                out_ref = _apply(ref, op)
                history.append(_fmt(op) + (" -> MemoryError" if out_ref[0] == "oom" else ""))
                try:
                    out_mine = _apply(mine, op)
                except NotImplementedError:
                    raise
                except Exception as e:  # noqa: BLE001
                    hint = ("when no free block is left, raise MemoryError (and change nothing)."
                            if out_ref[0] == "oom" else "the reference handles this operation.")
                    raise CheckFailure(f"your {op[0]} raised {type(e).__name__}: {e}",
                                       inputs=_history(history), show_values=False,
                                       hint=hint) from e
                if out_ref[0] == "ok":
                    if op[0] == "allocate":
                        live.append(op[1])
                    elif op[0] == "fork":
                        live.append(op[2])
                    elif op[0] == "free":
                        live.remove(op[1])
                    elif op[0] == "append_token" and out_ref[1] is not None:
                        cow += 1
                try:
                    _compare(mine, ref, live, num_blocks, op, out_mine, out_ref)
                except _Mismatch as m:
                    what, expected, actual, hint = m.args
                    raise CheckFailure(f"after these operations, {what} is wrong",
                                       inputs=_history(history), expected=expected,
                                       actual=actual, hint=hint) from None
                total_ops += 1
            for sid in list(live):
                ref.free(sid)
                mine.free(sid)
                live.remove(sid)
                history.append(f"free({sid!r})")
            if mine.num_free_blocks() != num_blocks:
                raise CheckFailure("blocks leaked: after freeing every sequence not all blocks "
                                   "are free", inputs=_history(history), expected=num_blocks,
                                   actual=mine.num_free_blocks(),
                                   hint="every reference must be dropped exactly once.")
        return (f"{total_ops} random operations in {num_sequences} sequences matched the "
                f"reference ({cow} copy-on-writes), no block leaked.")

    return run_check("block_allocator", body)


def _history(history: list[str]) -> str:
    tail = history if len(history) <= 14 else history[:1] + ["…"] + history[-12:]
    return "\n            ".join(tail)

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


class ReferenceAllocator:
    """The checker's oracle: the contract in the notebook, written out plainly."""

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
    """Everything the contract names, up to a renaming of physical block ids."""
    if out_mine[0] != out_ref[0]:
        want = "raise MemoryError" if out_ref[0] == "oom" else "succeed"
        raise _Mismatch(f"{_fmt(last_op)} should {want}",
                        "MemoryError" if out_ref[0] == "oom" else "success",
                        "MemoryError" if out_mine[0] == "oom" else "success",
                        "count free blocks before taking any; a failed call must change nothing.")
    pairs = _block_pairs(mine, ref, live, num_blocks)
    if out_ref[0] == "ok" and last_op[0] == "allocate":
        table = list(mine.block_table(last_op[1]))
        if not isinstance(out_mine[1], list) or list(out_mine[1]) != table:
            raise _Mismatch(f"{_fmt(last_op)} return value", table, out_mine[1],
                            "allocate returns the new sequence's block table (a list of ids).")
    if out_ref[0] == "ok" and last_op[0] == "append_token":
        _compare_cow(out_mine[1], out_ref[1], pairs, last_op)
    for m, r in pairs.items():
        if mine.ref_count(m) != ref.ref_count(r):
            raise _Mismatch(f"ref_count({m})", ref.ref_count(r), mine.ref_count(m),
                            "ref count = number of live block tables holding the block (fork adds "
                            "one per block, copy-on-write and free drop one).")
    for m in range(num_blocks):
        if m not in pairs and mine.ref_count(m) != 0:
            raise _Mismatch(f"ref_count({m}) of a block no live sequence holds", 0,
                            mine.ref_count(m), "a block nobody holds is free: ref count 0.")
    if mine.num_free_blocks() != ref.num_free_blocks():
        raise _Mismatch("num_free_blocks()", ref.num_free_blocks(), mine.num_free_blocks(),
                        "a block returns to the free list exactly when its ref count reaches 0 "
                        "(and never twice).")


def _block_pairs(mine: Any, ref: Any, live: list[str], num_blocks: int) -> dict[int, int]:
    """Your block id -> the reference's, from the live block tables; a mismatch if the tables
    differ in length or share blocks differently."""
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
    return pairs


def _compare_cow(got: Any, want: tuple[int, int] | None, pairs: dict[int, int],
                 op: tuple) -> None:
    """append_token's return: None, or the (src, dst) pair the engine copies KV along."""
    what = f"{_fmt(op)} return value"
    if want is None or got is None:
        if (want is None) != (got is None):
            raise _Mismatch(what, want, got,
                            "return (src, dst) only for a copy-on-write: the token lands in a "
                            "partly filled block that another sequence also holds.")
        return
    inv = {r: m for m, r in pairs.items()}
    expected = (inv.get(want[0], f"the shared block (ref's {want[0]})"),
                inv.get(want[1], f"the new block (ref's {want[1]})"))
    if not (isinstance(got, tuple) and len(got) == 2):
        raise _Mismatch(what, expected, got, "return a 2-tuple (src, dst).")
    if tuple(got) == expected[::-1]:
        raise _Mismatch(what, expected, got,
                        "the pair is swapped: (src, dst) = (the shared block whose KV is copied, "
                        "the new block that replaces it in this table); the engine copies src "
                        "-> dst, so a swapped pair copies the empty block over the shared one.")
    if tuple(got) != expected:
        raise _Mismatch(what, expected, got,
                        "src = the shared, partly filled block that was last in this table; "
                        "dst = the fresh block now in its place.")


def _run_case(allocator_cls: Callable[[int, int], Any], num_blocks: int, block_size: int,
              ops: list[tuple]) -> tuple[CheckFailure | None, int, int]:
    """Replay ``ops`` on yours and the reference; (first failure or None, ops run, CoWs)."""
    mine, ref = allocator_cls(num_blocks, block_size), ReferenceAllocator(num_blocks, block_size)
    live: list[str] = []
    history = [f"BlockAllocator(num_blocks={num_blocks}, block_size={block_size})"]
    done = cow = 0
    for op in ops:
        if op[1] not in live and op[0] != "allocate":
            continue  # its sequence is gone (freed, or never allocated after a shrink)
        out_ref = _apply(ref, op)
        history.append(_fmt(op) + (" -> MemoryError" if out_ref[0] == "oom" else ""))
        try:
            out_mine = _apply(mine, op)
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001
            hint = ("when no free block is left, raise MemoryError (and change nothing)."
                    if out_ref[0] == "oom" else "the reference handles this operation.")
            return CheckFailure(f"your {op[0]} raised {type(e).__name__}: {e}",
                                inputs=_history(history), show_values=False, hint=hint), done, cow
        if out_ref[0] == "ok":
            if op[0] in ("allocate", "fork"):
                live.append(op[1] if op[0] == "allocate" else op[2])
            elif op[0] == "free":
                live.remove(op[1])
            elif op[0] == "append_token" and out_ref[1] is not None:
                cow += 1
        try:
            _compare(mine, ref, live, num_blocks, op, out_mine, out_ref)
        except _Mismatch as m:
            what, expected, actual, hint = m.args
            return CheckFailure(f"after these operations, {what} is wrong",
                                inputs=_history(history), expected=expected, actual=actual,
                                hint=hint), done, cow
        done += 1
    for sid in list(live):
        ref.free(sid)
        mine.free(sid)
        history.append(f"free({sid!r})")
    if mine.num_free_blocks() != num_blocks:
        return CheckFailure("blocks leaked: after freeing every sequence not all blocks are free",
                            inputs=_history(history), expected=num_blocks,
                            actual=mine.num_free_blocks(),
                            hint="every reference must be dropped exactly once."), done, cow
    return None, done, cow


def _shrink(allocator_cls: Callable[[int, int], Any], num_blocks: int, block_size: int,
            ops: list[tuple], failure: CheckFailure) -> tuple[CheckFailure, int]:
    """Drop operations while the same mistake still shows: a short, complete history reads
    better than a long one with its middle cut. Returns (failure, operations dropped)."""
    kept = list(ops)
    i = len(kept) - 1
    while i >= 0:
        trial = kept[:i] + kept[i + 1:]
        try:
            f = _run_case(allocator_cls, num_blocks, block_size, trial)[0]
        except NotImplementedError:  # the shorter run reached a method you have not written
            f = None
        if f is not None and f.what == failure.what:
            kept, failure = trial, f
        i -= 1
    return failure, len(ops) - len(kept)


def check(allocator_cls: Callable[[int, int], Any], *, num_sequences: int = 60,
          ops_per_sequence: int = 40, seed: int = 0) -> object:
    """Random operation sequences against the reference; the first divergence is reported with
    the shortest operation history that still shows it."""

    def body() -> str:
        rng = random.Random(seed)
        total_ops = cow = 0
        for _ in range(num_sequences):
            num_blocks, block_size = rng.choice([(4, 1), (8, 4), (16, 4), (12, 3), (32, 16)])
            ops = _random_ops(rng, ops_per_sequence)
            failure, done, n_cow = _run_case(allocator_cls, num_blocks, block_size, ops)
            if failure is not None:
                failure, dropped = _shrink(allocator_cls, num_blocks, block_size, ops, failure)
                if dropped:
                    failure.inputs += (f"\n            (the complete history: {dropped} other "
                                       "operations of the random sequence were left out, these "
                                       "alone show the same mistake)")
                raise failure
            total_ops, cow = total_ops + done, cow + n_cow
        return (f"{total_ops} random operations in {num_sequences} sequences matched the "
                f"reference ({cow} copy-on-writes), no block leaked.")

    return run_check("block_allocator", body)


def _history(history: list[str]) -> str:
    return "\n            ".join(history)

"""Exercise 12, part 2: where the all-reduce goes, checked on threads and then on 2 processes.

The learner's ``attention_forward(x, shard, attend, all_reduce)`` runs on every rank. First the
ranks are threads of this process whose ``all_reduce`` meets through a barrier (a ``TPGroup``
whose collective is a sum over threads: the same counting, no processes), so a wrong answer is
diagnosed in milliseconds; then the same function is sent to 2 spawned processes in one gloo
group (``labkit.parallel.workers.WorkerGroup``, the engine's own workers and ``TPGroup``), the
real collective. Every rank's output must equal the unsharded labkit block, with exactly one
all-reduce. Workers are bounded in time and stopped on every path.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NoReturn

import torch

from labkit.exercises.checks import CheckFailure, call, run_check
from labkit.exercises.portable import PortableFunction, portable
from labkit.exercises.tp_attention import (
    FORWARD_CASES,
    Attend,
    Block,
    build_block,
    compare_shards,
    learner_shards,
    partial_output,
)
from labkit.parallel.comm import TPGroup
from labkit.parallel.workers import WorkerError, WorkerGroup

Shards = list[dict[str, torch.Tensor]]
#: per rank: (output, [(site, kind, bytes), ...] of its collectives)
RankResult = tuple[Any, list[tuple[str, str, int]]]


def _reduce_fn(group: TPGroup) -> Callable[[torch.Tensor], torch.Tensor]:
    def all_reduce(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"all_reduce takes a tensor, got {type(t).__name__}")
        return group.all_reduce(t.contiguous(), f"shape {list(t.shape)}")

    return all_reduce


def run_rank(fn: Callable, x: torch.Tensor, shard: dict[str, torch.Tensor], attend: Attend,
             group: TPGroup) -> RankResult:
    """One rank's forward; what it returned and the collectives it made."""
    group.log.reset()
    with torch.no_grad():
        out = fn(x.clone(), {k: v.clone() for k, v in shard.items()}, attend, _reduce_fn(group))
    return out, list(group.log.calls)


class _Board:
    """Where thread-ranks meet: each drops its tensor, all wait, all read the sum."""

    def __init__(self, world: int, timeout_s: float = 10.0) -> None:
        self.slots: list[torch.Tensor | None] = [None] * world
        self.barrier = threading.Barrier(world, timeout=timeout_s)
        self.timeout_s, self.aborted = timeout_s, False

    def abort(self) -> None:
        """A rank failed: the others stop waiting for it."""
        self.aborted = True
        self.barrier.abort()

    def all_reduce(self, rank: int, x: torch.Tensor) -> torch.Tensor:
        self.slots[rank] = x.detach().clone()
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            if self.aborted:
                raise
            raise TimeoutError(f"rank {rank} waited {self.timeout_s:.0f} s in all_reduce for the "
                               "other ranks: every rank must make the same all_reduce calls, in "
                               "the same order") from None
        try:
            total = torch.stack(self.slots).sum(0)  # type: ignore[arg-type]
        except RuntimeError as e:
            raise ValueError(f"the ranks all-reduced tensors of different shapes "
                             f"{[list(s.shape) for s in self.slots if s is not None]}") from e
        self.barrier.wait()
        return x.copy_(total)


class ThreadGroup(TPGroup):
    """A rank that is a thread: ``TPGroup``'s counting, the sum taken through a ``_Board``."""

    def __init__(self, rank: int, world: int, board: _Board) -> None:
        super().__init__(rank, world)
        self.board = board

    def all_reduce(self, x: torch.Tensor, site: str = "") -> torch.Tensor:
        self.log.add("all_reduce", x, site)
        return self.board.all_reduce(self.rank, x)


def run_threads(fn: Callable, block: Block, shards: Shards) -> list[RankResult]:
    world = block.case.world
    board = _Board(world)
    results: list[Any] = [None] * world
    errors: list[BaseException] = []

    def rank_main(rank: int) -> None:
        try:
            results[rank] = call(run_rank, fn, block.x, shards[rank], Attend(block.case.head_dim),
                                 ThreadGroup(rank, world, board),
                                 _label=f"attention_forward on rank {rank} of {world} "
                                        f"({block.case})")
        except BaseException as e:  # noqa: BLE001 - re-raised in the checker's thread
            errors.append(e)
            board.abort()

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        firsts = [e for e in errors if not isinstance(e.__cause__, threading.BrokenBarrierError)]
        raise (firsts or errors)[0]
    return results


# ---- the real run: spawned processes, gloo ----------------------------------------------
@dataclass
class RankJob:
    """What each worker process builds at start (picklable)."""

    forward: PortableFunction
    cases: list[tuple[torch.Tensor, Shards, int]]  # (x, shards per rank, head_dim)

    def __call__(self, group: TPGroup) -> RankRunner:
        return RankRunner(self.forward.load(), self.cases, group)


class RankRunner:
    def __init__(self, fn: Callable, cases: list, group: TPGroup) -> None:
        self.fn, self.cases, self.group = fn, cases, group

    def run(self) -> list[RankResult]:
        return [run_rank(self.fn, x, shards[self.group.rank], Attend(d), self.group)
                for x, shards, d in self.cases]


def run_processes(fn: Callable, blocks: list[Block], shards: list[Shards],
                  timeout_s: float = 60.0) -> list[list[RankResult]]:
    """Per block, per rank: the results of the learner's forward on 2 gloo processes."""
    job = RankJob(portable(fn), [(b.x, s, b.case.head_dim) for b, s in zip(blocks, shards)])
    group = WorkerGroup(2, job, timeout_s=timeout_s, start_timeout_s=120.0)
    try:
        per_rank = group.call("run")
    finally:
        group.shutdown()
    return [[per_rank[r][i] for r in range(2)] for i in range(len(blocks))]


def _worker_hint(e: WorkerError) -> str:
    text = str(e)
    if "NameError" in text:
        return ("the forward runs in another process and sees only what it names: modules, "
                "functions defined in the notebook and picklable values; define what it needs "
                "inside it")
    if "during start" in text:
        return ("if you run this check from a Python script, call it under "
                "`if __name__ == \"__main__\":` (workers are spawned and import the script)")
    if "did not answer" in text:
        return "do all ranks make the same all_reduce calls, in the same order?"
    return "read the worker's traceback above"


# ---- diagnosis ---------------------------------------------------------------------------
def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a, b, atol=1e-4, rtol=1e-4))


def diagnose(block: Block, shards: Shards, results: list[RankResult], where: str) -> int:
    """Raise CheckFailure naming the mistake; return the all-reduce count when right."""
    c = block.case
    inputs = f"{c}; {where}"
    outs = [o for o, _ in results]
    calls = results[0][1]
    for r, o in enumerate(outs):
        if not isinstance(o, torch.Tensor) or tuple(o.shape) != tuple(block.full.shape) \
                or o.dtype != block.full.dtype:
            raise CheckFailure(f"rank {r} returned the wrong thing", inputs=inputs,
                               expected=f"float32 [tokens, hidden] = {list(block.full.shape)}",
                               actual=o)
    if all(_close(o, block.full) for o in outs):
        if len(calls) != 1:
            raise CheckFailure("right output, but not one all-reduce per block", inputs=inputs,
                               expected=1, actual=[s for s, _, _ in calls],
                               hint="every all-reduce makes all GPUs wait for each other; one, "
                                    "on o_proj's output, completes the block")
        return len(calls)
    _name_the_mistake(block, shards, outs, calls, inputs)


def _name_the_mistake(block: Block, shards: Shards, outs: list[torch.Tensor],
                      calls: list[tuple[str, str, int]], inputs: str) -> NoReturn:
    """Recompute the per-rank partial sums and match the wrong output against each classic
    mistake, so the learner reads which one it was rather than a bare mismatch."""
    c = block.case
    att = Attend(c.head_dim)
    parts = [partial_output(block.x, s, att) for s in shards]
    total = sum(parts)
    b = block.weights.get("o_proj.bias", torch.zeros(c.hidden))
    w = c.world
    common = dict(inputs=inputs, expected=block.full, actual=outs[0])
    if not calls or all(_close(o, p) or _close(o, p + b) for o, p in zip(outs, parts)):
        raise CheckFailure(
            f"the all-reduce is missing: each rank returned only its own heads' share "
            f"({len(calls)} all-reduce(s) made)",
            hint="o_proj is row-parallel, so each rank's o_proj output is a partial sum over its "
                 "heads: all_reduce it (then add o_proj's bias, once)", **common)
    if all(_close(o, w * total + b) or _close(o, w * (total + b)) for o in outs):
        raise CheckFailure(f"the output is {w}x the block's: a tensor that was already complete "
                           "was summed over the ranks again",
                           hint="all-reduce once, only o_proj's partial output", **common)
    if bool(b.abs().max() > 0) and all(_close(o, total + w * b) for o in outs):
        raise CheckFailure(f"o_proj's bias was added on every rank before the all-reduce, so it "
                           f"counts {w} times", hint="add the bias once, after the all-reduce",
                           **common)
    if bool(b.abs().max() > 0) and all(_close(o, total) for o in outs):
        raise CheckFailure("o_proj's bias is missing", hint="add shard['o_proj.bias'] (when "
                           "present) after the all-reduce", **common)
    odd = [s for s, _, _ in calls if not s.endswith(f", {c.hidden}]")]
    if odd:
        raise CheckFailure(
            f"you all-reduced {odd[0]}: q, k, v and the attention output of one rank belong to "
            "its own heads, complete already; summing them mixes different heads",
            hint="the only partial sums are o_proj's outputs: all-reduce after o_proj", **common)
    err = float(max((o - block.full).abs().max() for o in outs))
    raise CheckFailure(f"wrong block output (max |Δ| {err:.3g}); all-reduces: "
                       f"{[s for s, _, _ in calls]}", hint="q/k/v from x, attend, o_proj, "
                       "all_reduce, then the bias", **common)


def _shards_for(block: Block, shard_attention: Callable | None) -> Shards:
    if shard_attention is None:
        return [block.expected_shard(r) for r in range(block.case.world)]
    shards = learner_shards(shard_attention, block)
    compare_shards(block, shards)  # a wrong split is reported as such, not as a wrong forward
    return shards


def check_forward(attention_forward: Callable, shard_attention: Callable | None = None,
                  processes: bool = True) -> Any:
    """Part 2: threads first, then 2 gloo processes; every rank's output equals the block's.

    ``shard_attention``: the learner's slicing (after ``check_shard`` passed), else labkit's."""
    def body() -> str:
        blocks = [build_block(c) for c in FORWARD_CASES]
        shards = [_shards_for(b, shard_attention) for b in blocks]
        for b, s in zip(blocks, shards):
            diagnose(b, s, run_threads(attention_forward, b, s), "ranks as threads")
        if not processes:
            return f"right on {len(blocks)} blocks with the ranks as threads."
        try:
            real = run_processes(attention_forward, blocks, shards)
        except WorkerError as e:
            raise CheckFailure(f"the run on 2 processes failed: {e}", show_values=False,
                               hint=_worker_hint(e)) from e
        for b, s, res in zip(blocks, shards, real):
            diagnose(b, s, res, "2 gloo processes")
        c = blocks[0].case
        nbytes = real[0][0][1][0][2]
        assert nbytes == c.tokens * c.hidden * 4  # the formula: [tokens, hidden] float32
        whose = "your" if shard_attention is not None else "labkit's"
        return (f"on 2 processes over torch.distributed (gloo), with {whose} slices, every "
                f"rank's output equals the unsharded block on {len(blocks)} blocks (GQA, MQA, "
                f"MHA), with one all-reduce per block of tokens x hidden x 4 = {nbytes} bytes.")

    return run_check("tp_attention_forward", body)

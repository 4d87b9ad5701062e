"""Trace: one record per engine step, and ``replay`` to rebuild the KV state at any step.

The trace is what widgets scrub through and benches summarise. Its block events are complete
enough that the block tables, reference counts and free / cached sets after any step are a pure
fold over the events up to it; ``replay`` is that fold, and a test checks it against the live
block manager at every step.

Event semantics (GPU pool unless noted), applied in order:
- ``alloc``: ``physical`` (fresh, ref 1) becomes ``logical`` block of ``seq_id``;
- ``evict``: cached ``physical`` loses its prefix-cache entry and becomes free (the next alloc
  takes it);
- ``prefix_hit`` / ``fork``: ``seq_id`` shares ``physical`` (ref + 1; leaves the cached set);
- ``cow``: copy-on-write, ``logical`` now maps to fresh ``physical``; ``src`` loses a reference;
- ``free``: ``seq_id`` drops ``physical`` (ref - 1); at ref 0 it is ``cached`` (extra key,
  kept for prefix hits) or free;
- ``swap_out``: ``src`` (GPU) copied to CPU block ``physical`` (the GPU block's ``free`` follows);
- ``swap_in``: CPU block ``src`` copied into GPU ``physical`` (its ``alloc`` came just before);
  the CPU block is released;
- ``swap_free``: a sequence aborted while swapped out releases CPU block ``physical``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class Trace:
    def __init__(self, meta: dict[str, Any] | None = None) -> None:
        self.meta: dict[str, Any] = dict(meta or {})
        self.requests: dict[str, dict[str, Any]] = {}
        self.steps: list[dict[str, Any]] = []

    def __len__(self) -> int:
        return len(self.steps)

    def to_dict(self) -> dict[str, Any]:
        return {"meta": self.meta, "requests": self.requests, "steps": self.steps}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trace:
        t = cls(d["meta"])
        t.requests = dict(d["requests"])
        t.steps = list(d["steps"])
        return t

    def to_json(self, path: str | Path | None = None) -> str:
        s = json.dumps(self.to_dict())
        if path is not None:
            Path(path).write_text(s)
        return s

    @classmethod
    def from_json(cls, path_or_text: str | Path) -> Trace:
        p = Path(path_or_text) if not str(path_or_text).lstrip().startswith("{") else None
        return cls.from_dict(json.loads(p.read_text() if p else str(path_or_text)))


@dataclass
class PoolSnapshot:
    block_tables: dict[str, list[int]] = field(default_factory=dict)
    ref_counts: dict[int, int] = field(default_factory=dict)  # used blocks only
    cached: set[int] = field(default_factory=set)
    free: set[int] = field(default_factory=set)
    cpu_block_tables: dict[str, list[int]] = field(default_factory=dict)
    seq_tokens: dict[str, list[int]] = field(default_factory=dict)


class _Fold:
    """The pool state ``replay`` folds the events into."""

    def __init__(self, num_blocks: int) -> None:
        self.tables: dict[str, dict[int, int]] = {}
        self.cpu: dict[str, dict[int, int]] = {}
        self.refs = [0] * num_blocks
        self.free, self.cached = set(range(num_blocks)), set()

    def apply(self, ev: dict[str, Any]) -> None:
        kind, sid, lg, ph = ev["type"], ev["seq_id"], ev["logical"], ev["physical"]
        if kind in ("alloc", "cow", "prefix_hit", "fork"):
            self._hold(kind, sid, lg, ph, ev["src"])
        elif kind == "evict":
            self.cached.discard(ph)
            self.free.add(ph)
        elif kind == "free":
            self.refs[ph] -= 1
            self.tables[sid].pop(lg, None)
            if not self.tables[sid]:
                del self.tables[sid]
            if self.refs[ph] == 0:
                (self.cached if ev.get("cached") else self.free).add(ph)
        elif kind == "swap_out":
            self.cpu.setdefault(sid, {})[lg] = ph
        elif kind in ("swap_in", "swap_free"):  # swap_free: aborted while swapped out
            self.cpu[sid].pop(lg, None)
            if not self.cpu[sid]:
                del self.cpu[sid]
        else:
            raise ValueError(f"unknown trace event type {kind!r}")

    def _hold(self, kind: str, sid: str, lg: int, ph: int, src: int | None) -> None:
        """``seq_id``'s logical block ``lg`` now maps to ``ph``: fresh (alloc, cow) or shared."""
        if kind in ("prefix_hit", "fork"):
            self.cached.discard(ph)
            self.refs[ph] += 1
        else:
            self.free.discard(ph)
            self.refs[ph] = 1
            if kind == "cow":
                self.refs[src] -= 1
        self.tables.setdefault(sid, {})[lg] = ph


def _request_of(t: Trace, sid: str) -> str:
    return sid if sid in t.requests else sid.rsplit(":", 1)[0]


def replay(trace: Trace | dict, step: int) -> PoolSnapshot:
    """State after step index ``step`` (negative counts from the end), from the trace alone."""
    t = trace if isinstance(trace, Trace) else Trace.from_dict(trace)
    if step < 0:
        step += len(t.steps)
    if not 0 <= step < len(t.steps):
        raise ValueError(f"step {step} out of range: the trace has {len(t.steps)} steps")
    fold = _Fold(t.meta["num_blocks"])
    tokens: dict[str, list[int]] = {}
    prompts = {rid: r.get("prompt_token_ids") for rid, r in t.requests.items()}
    for rec in t.steps[: step + 1]:
        for ev in rec["events"]:
            fold.apply(ev)
        for sid, new in rec["outputs"].items():
            if sid not in tokens:
                p = prompts.get(_request_of(t, sid))
                tokens[sid] = list(p) if p is not None else []
            tokens[sid].extend(new)
    return PoolSnapshot(
        block_tables={s: [tb[i] for i in sorted(tb)] for s, tb in fold.tables.items()},
        ref_counts={b: r for b, r in enumerate(fold.refs) if r > 0},
        cached=fold.cached, free=fold.free,
        cpu_block_tables={s: [tb[i] for i in sorted(tb)] for s, tb in fold.cpu.items()},
        seq_tokens={s: tok for s, tok in tokens.items()
                    if prompts.get(_request_of(t, s)) is not None},
    )


class TraceObserver:
    """Appends one record per engine step to ``trace`` (called once per step by the engine).

    Everything it needs comes in the call or is drained from where it accumulates: block events
    from the block manager, finish records (including aborts between steps) from the
    scheduler. ``enabled = False`` (long simulations) still drains both, so nothing grows.

    ``probes`` add fields from outside the engine: ``name -> callable()`` read once per recorded
    step; a value that is not None lands in the record under ``name`` (an MoE model's
    ``expert_load``, :class:`labkit.model.moe.ExpertLoadProbe`). The engine's step is the same
    with or without them."""

    def __init__(self, trace: Trace, real_tokens: bool = True) -> None:
        self.trace = trace
        self.real_tokens = real_tokens
        self.enabled = True
        self.probes: dict[str, Callable[[], Any]] = {}

    def on_request(self, request_id: str, ids: list[int], params: Any, priority: int,
                   arrival: float) -> None:
        if self.enabled:
            self.trace.requests[request_id] = {
                "prompt_token_ids": ids if self.real_tokens else None, "prompt_len": len(ids),
                "priority": priority, "arrival_time": arrival, "n": params.n,
                "max_tokens": params.max_tokens}

    def on_step(self, scheduler: Any, out: Any, t0: float, dur: float,
                appended: dict[str, list[int]], spec: list[dict],
                collectives: dict[str, dict[str, int]] | None = None) -> None:
        events = scheduler.bm.take_events()
        finished = scheduler.take_finished()
        if self.enabled:
            rec = step_record(len(self.trace.steps), scheduler, out, t0, dur, appended,
                              finished, events, spec)
            if collectives:  # tensor parallelism only: {kind: {"count", "bytes"}}
                rec["collectives"] = collectives
            for name, probe in self.probes.items():
                value = probe()
                if value is not None:
                    rec[name] = value
            self.trace.steps.append(rec)


def step_record(index: int, sched: Any, out: Any, t0: float, dur: float,
                results: dict[str, list[int]], finished: list[dict], events: list[dict],
                spec: list[dict]) -> dict[str, Any]:
    """One step's record (the schema in the module docstring) from the scheduler's live state."""
    bm = sched.bm
    pool = bm.pool
    return {
        "step": index, "time": t0, "duration": dur,
        "scheduled": [{"request_id": s.seq.request_id, "seq_id": s.seq.seq_id,
                       "phase": "prefill" if s.is_prefill else "decode",
                       "num_tokens": s.num_new_tokens, "start_pos": s.start_pos,
                       "chunked": not s.samples} for s in out.scheduled],
        "num_batched_tokens": out.num_batched_tokens, "token_budget": out.token_budget,
        "outputs": results,  # tokens appended this step (after stop conditions)
        "preempted": [{"request_id": s.request_id, "seq_id": s.seq_id, "mode": m}
                      for s, m in out.preempted],
        "finished": finished, "events": events,
        "kv": {"used": pool.num_used, "free": pool.num_free, "cached": pool.num_cached,
               "total": pool.num_blocks, "token_slots_used": bm.token_slots_used()},
        "queues": {"waiting": sched.num_waiting, "running": len(sched.running),
                   "swapped": len(sched.swapped)},
        "spec": spec,
    }

"""Three prefix-cache bugs reported against nano-vllm, re-run as scenarios on labkit's engine.

Why here: each bug needed a specific situation (a fully cached prompt, a freed block whose hash
entry survived, two identical prefixes admitted in one step) that ordinary tests never reach, so
each scenario drives the engine into it on purpose and checks outputs, block accounting and the
cache's own consistency. Notebook 03 runs them; ``BUG_PATCHES`` puts each bug back into one
engine, the negative control that shows every check can fail.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from labkit.engine.sampling_params import SamplingParams
from labkit.exercises.shared import tiny_engine
from labkit.kv.prefix import hash_prompt_blocks

# ---- three prefix-cache bugs reported against nano-vllm, run on labkit's engine ----------------
#
# Each scenario drives the real engine (tiny model) into the situation a reported bug needed and
# checks what would have gone wrong: greedy outputs against ``labkit.model.generate`` (the
# reference, no cache at all), the block accounting (``check_kv_invariants`` / no leaks), and a
# watch on the prefix cache itself: every key maps to a block that still carries that key, and a
# block's KV never changes while it is published under a key. ``patch`` lets a test (or a
# curious learner) re-introduce a bug into one engine and see the scenario catch it: the
# negative control that shows each check can fail.

NANO_VLLM = "https://github.com/GeeeekExplorer/nano-vllm/"
BUG_REPORTS = {  # where each was reported
    "fully_cached": NANO_VLLM + "pull/199", "stale_hash": NANO_VLLM + "issues/163",
    "same_step_twins": NANO_VLLM + "issues/219"}
PREFIX_CACHE_BUGS = {
    "fully_cached": "a fully cached prompt leaves zero tokens to compute (no logits to sample)",
    "stale_hash": "a stale hash entry points at a block that was freed and reused for other "
                  "content",
    "same_step_twins": "two identical prefixes admitted in the same step get duplicate blocks",
}


@dataclass
class Scenario:
    """What one scenario found: ``survived`` is True when no check failed."""

    name: str
    bug: str
    survived: bool
    evidence: str
    problems: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        mark = "✓ survived" if self.survived else "✗ FAILED"
        lines = [f"{mark}  {self.name}: {self.bug}", f"    {self.evidence}"]
        lines += [f"    problem: {p if len(p) <= 160 else p[:159] + '…'}"
                  for p in self.problems[:3]]
        if len(self.problems) > 3:
            lines.append(f"    ... and {len(self.problems) - 3} more")
        return "\n".join(lines)


class _CacheWatch:
    """Called after every step: each published key maps to a block carrying that key, and a
    published block's K/V (every layer) equals what it held when the key was first seen."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.snapshots: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}
        self.found: dict[str, None] = {}  # each problem once, in the order first seen

    @property
    def problems(self) -> list[str]:
        return list(self.found)

    def _kv(self, block: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        kv = getattr(self.engine.executor, "kv_cache", None)
        if kv is None:
            return None
        return (torch.stack([c[block] for c in kv.k_caches]).float().clone(),
                torch.stack([c[block] for c in kv.v_caches]).float().clone())

    def check(self) -> None:
        pool = self.engine.block_manager.pool
        for h, b in pool.hash_to_block.items():
            if pool.block_hash[b] != h:
                self.found.setdefault(f"key {h.hex()[:8]} points at block {b}, which no longer "
                                     "carries that key (freed and reused: a stale entry)")
                continue
            now = self._kv(b)
            if now is None:
                continue
            old = self.snapshots.setdefault(h, now)
            if old is not now and not all(torch.allclose(o, n, atol=1e-4, rtol=1e-3)
                                          for o, n in zip(old, now)):
                self.found.setdefault(f"block {b} under key {h.hex()[:8]} changed its KV while "
                                     "published: a hit would read another prompt's KV")
        for b, h in enumerate(pool.block_hash):
            if h is not None and pool.hash_to_block.get(h) != b:
                self.found.setdefault(f"block {b} carries key {h.hex()[:8]} but the key maps to "
                                     f"{pool.hash_to_block.get(h)}: evicting it would drop "
                                     "another block's entry")


def _serve(engine: Any, requests: list[tuple[str, list[int]]], max_tokens: int,
           watch: _CacheWatch, problems: list[str]) -> dict[str, list[int]]:
    """Add every request, step until all finish (checking invariants and the watch after every
    step); returns each request's output tokens (a crash becomes a problem, not an exception)."""
    from labkit.engine.invariants import check_kv_invariants

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    out: dict[str, list[int]] = {rid: [] for rid, _ in requests}
    if problems:  # an earlier part of the scenario already failed: the engine's state is suspect
        return out
    try:
        for rid, prompt in requests:
            engine.add_request(rid, list(prompt), params)
        for _ in range(10_000):
            if not engine.has_unfinished_requests():
                break
            for o in engine.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
            check_kv_invariants(engine)
            watch.check()
    except Exception as e:  # noqa: BLE001 - a crash is what some of these bugs do
        problems.append(f"the engine raised {type(e).__name__}: {e}")
    return out


_OK = ("", "; every output = the reference")


def _first_prefill(engine: Any) -> dict[str, int]:
    """Tokens each request computed in its first scheduled step (its prefill after the hits)."""
    first: dict[str, int] = {}
    for step in engine.trace.steps:
        for s in step["scheduled"]:
            first.setdefault(s["request_id"], s["num_tokens"])
    return first


def _cached_tokens(engine: Any) -> dict[str, int]:
    return {t["request_id"]: t["num_cached_tokens"] for t in engine.request_timings()}


def _compare(engine: Any, outs: dict[str, list[int]], prompts: dict[str, list[int]],
             max_tokens: int, problems: list[str]) -> None:
    from labkit.model.generate import generate

    model = engine.executor.runner.model if hasattr(engine.executor, "runner") else None
    for rid, prompt in prompts.items():
        want = generate(model, prompt, max_tokens, ignore_eos=True)
        if outs.get(rid) != want:
            problems.append(f"{rid}: greedy output {outs.get(rid)} differs from the reference "
                            f"{want} (generate without any cache)")


def _finish(engine: Any, problems: list[str]) -> None:
    from labkit.engine.invariants import assert_no_leaks

    if not problems:
        try:
            assert_no_leaks(engine)
        except AssertionError as e:
            problems.append(f"leak: {e}")


def _new_engine(patch: Callable[[Any], None] | None, **kw: Any) -> Any:
    engine = tiny_engine(**kw)
    if patch is not None:
        patch(engine)
    return engine


def scenario_fully_cached(patch: Callable[[Any], None] | None = None) -> Scenario:
    """Prompts whose every full block is cached: block-aligned (8 tokens), a prompt extending
    the first one by its own generated tokens (their KV was cached too), and one leaving a single
    token. Each must still compute at least one token (the last: its logits give the next
    token) and generate exactly the reference."""
    engine = _new_engine(patch, block_size=4, num_blocks=64, max_num_seqs=4)
    watch, problems = _CacheWatch(engine), []
    p = [(7 * i + 3) % 128 for i in range(8)]
    outs = _serve(engine, [("r0", p)], 6, watch, problems)
    gen = outs["r0"]
    prompts = {"r0": p, "r1": list(p), "r2": p + gen[:4], "r3": p + gen[:5]}
    for rid in ("r1", "r2", "r3"):  # one after another: each finds the previous ones cached
        outs.update(_serve(engine, [(rid, prompts[rid])], 6, watch, problems))
    first, cached = _first_prefill(engine), _cached_tokens(engine)
    for rid, prompt in prompts.items():
        if rid in first and first[rid] < 1:
            problems.append(f"{rid}: {cached.get(rid)} of {len(prompt)} prompt tokens from the "
                            f"cache left {first[rid]} to compute")
    if not problems:
        _compare(engine, outs, prompts, 6, problems)
    problems += watch.problems
    _finish(engine, problems)
    rows = ", ".join(f"{rid} {cached.get(rid, 0)}/{len(prompts[rid])} cached, computed "
                     f"{first.get(rid, 0)}" for rid in ("r1", "r2", "r3"))
    return Scenario("fully_cached", PREFIX_CACHE_BUGS["fully_cached"], not problems,
                    rows + _OK[not problems], problems)


def scenario_stale_hash(patch: Callable[[Any], None] | None = None) -> Scenario:
    """An 8-block pool: A's 3 cached blocks, then B needs 7 blocks and evicts A's two tail blocks
    (least recently freed), reusing those physical blocks for B's tokens. A again must hit only
    its surviving root block, never the reused ones, and generate exactly the reference."""
    engine = _new_engine(patch, block_size=4, num_blocks=8, max_num_seqs=2)
    watch, problems = _CacheWatch(engine), []
    a = [(5 * i + 1) % 128 for i in range(10)]
    b = [(11 * i + 60) % 128 for i in range(20)]
    pool = engine.block_manager.pool
    outs = _serve(engine, [("A", a)], 6, watch, problems)
    a_blocks = {h: blk for h, blk in pool.hash_to_block.items()}
    outs.update(_serve(engine, [("B", b)], 6, watch, problems))
    b_reused = sorted(blk for blk in a_blocks.values()
                      if any(e["type"] == "alloc" and e["request_id"] == "B"
                             and e["physical"] == blk for s in engine.trace.steps
                             for e in s["events"]))
    outs.update(_serve(engine, [("A again", a)], 6, watch, problems))
    cached = _cached_tokens(engine)
    if not problems:
        _compare(engine, outs, {"A": a, "B": b, "A again": a}, 6, problems)
    if not b_reused and not problems:
        problems.append("B reused none of A's blocks: the scenario did not happen")
    problems += watch.problems
    _finish(engine, problems)
    return Scenario("stale_hash", PREFIX_CACHE_BUGS["stale_hash"], not problems,
                    f"B took over A's cached blocks {b_reused} ({pool.num_evictions} evictions); "
                    f"A again: {cached.get('A again', 0)} of {len(a)} prompt tokens from the "
                    "cache" + _OK[not problems], problems)


def scenario_same_step_twins(patch: Callable[[Any], None] | None = None) -> Scenario:
    """Two identical 14-token prompts and a third sharing their first 8 tokens, admitted in the
    same step: nothing is published yet, so each computes its own copy of the shared blocks. One
    copy is published, the others stay private and are freed, not cached and not lost; a later
    request hits the published copy, and evicting everything afterwards (a 16-block pool, two
    unrelated prompts) still leaves the cache consistent."""
    engine = _new_engine(patch, block_size=4, num_blocks=16, max_num_seqs=4,
                         max_num_batched_tokens=64)
    watch, problems = _CacheWatch(engine), []
    p = [(3 * i + 9) % 128 for i in range(14)]
    q = p[:8] + [100, 101, 102, 103, 104, 105]
    prompts = {"twin 1": p, "twin 2": list(p), "cousin": q}
    outs = _serve(engine, list(prompts.items()), 6, watch, problems)
    first_step = {s["request_id"] for s in engine.trace.steps[0]["scheduled"]} \
        if engine.trace.steps else set()
    if set(prompts) - first_step and not problems:
        problems.append(f"only {sorted(first_step)} were admitted in the first step")
    pool = engine.block_manager.pool
    published = len(pool.hash_to_block)
    distinct = len({h for x in (p + outs["twin 1"][:-1], q + outs["cousin"][:-1])
                    for h in hash_prompt_blocks(x, 4)})
    if published != distinct and not problems:
        problems.append(f"{published} keys published for {distinct} distinct full blocks")
    more = {"later": list(p), "other 1": [(13 * i + 2) % 128 for i in range(40)],
            "other 2": [(17 * i + 5) % 128 for i in range(40)], "twin again": list(p)}
    for rid, prompt in more.items():
        outs.update(_serve(engine, [(rid, prompt)], 6, watch, problems))
    cached = _cached_tokens(engine)
    if not problems:
        _compare(engine, outs, {**prompts, **more}, 6, problems)
    problems += watch.problems
    _finish(engine, problems)
    return Scenario("same_step_twins", PREFIX_CACHE_BUGS["same_step_twins"], not problems,
                    f"admitted together: {sorted(first_step)}; {published} keys published for "
                    f"{distinct} distinct full blocks"
                    + (" (the twins' duplicates stayed private and were freed)" * (not problems))
                    + f"; a later twin reused {cached.get('later', 0)} of {len(p)} "
                    f"prompt tokens; {pool.num_evictions} evictions after" + _OK[not problems],
                    problems)


SCENARIOS: dict[str, Callable[..., Scenario]] = {
    "fully_cached": scenario_fully_cached, "stale_hash": scenario_stale_hash,
    "same_step_twins": scenario_same_step_twins}


def prefix_cache_scenarios(patch: Callable[[Any], None] | None = None) -> list[Scenario]:
    """All three scenarios (each on its own engine), optionally with a bug ``patch``ed in."""
    return [run(patch) for run in SCENARIOS.values()]


# The bugs themselves, put back into one engine's block manager (negative controls): each is the
# smallest change to labkit's code that reproduces the reported behaviour.

def _bug_fully_cached(engine: Any) -> None:
    """find_cached_prefix hits every full block, even when that covers the whole prompt."""
    bm = engine.block_manager

    def find_cached_prefix(seq: Any) -> tuple[list[int], list[bytes]]:
        if seq.num_computed_tokens:
            return [], []
        hashes = hash_prompt_blocks(seq.token_ids, bm.block_size, seq.cache_salt)  # no "- 1"
        blocks: list[int] = []
        for h in hashes:
            b = bm.pool.lookup(h)
            if b is None:
                break
            blocks.append(b)
        return blocks, hashes[:len(blocks)]

    bm.find_cached_prefix = find_cached_prefix


def _bug_stale_hash(engine: Any) -> None:
    """Evicting a cached block forgets the block's key but leaves the key -> block entry."""
    pool = engine.block_manager.pool

    def _uncache(block_id: int) -> None:
        pool.block_hash[block_id] = None  # hash_to_block keeps pointing here

    pool._uncache = _uncache


def _bug_same_step_twins(engine: Any) -> None:
    """Publishing a second copy of a block overwrites the first copy's entry."""
    pool = engine.block_manager.pool

    def register(block_id: int, block_hash: bytes) -> bool:
        if pool.block_hash[block_id] is not None:
            return False
        pool.block_hash[block_id] = block_hash
        pool.hash_to_block[block_hash] = block_id  # the twin's copy replaces the first one
        return True

    pool.register = register


BUG_PATCHES: dict[str, Callable[[Any], None]] = {
    "fully_cached": _bug_fully_cached, "stale_hash": _bug_stale_hash,
    "same_step_twins": _bug_same_step_twins}

"""A hand-written trace, exactly per the schema in labkit.engine.trace, and a reference fold.

The scenario (block_size 4, 10 physical blocks, token budget 8) exercises every picture the
widgets draw: A and B share a prefix block, C is prefilled in two chunks, D hits a prefix that is
cached-but-free, D is preempted (recompute) and rescheduled, and a cached block is evicted;
the trace ends with D still running (a trace of an engine mid-flight).
"""

from __future__ import annotations

from dataclasses import dataclass, field

BS = 4


def _ev(kind, rid, logical, physical, src=None, cached=None):
    ev = {"type": kind, "request_id": rid, "seq_id": rid, "logical": logical,
          "physical": physical, "src": src}
    if cached is not None:  # free events say whether the block stays prefix-cached at ref 0
        ev["cached"] = cached
    return ev


def _sched(rid, phase, n, start, chunked=False):
    return {"request_id": rid, "seq_id": rid, "phase": phase, "num_tokens": n,
            "start_pos": start, "chunked": chunked}


@dataclass
class RefSnapshot:
    block_tables: dict = field(default_factory=dict)
    ref_counts: dict = field(default_factory=dict)
    cached: set = field(default_factory=set)
    free: set = field(default_factory=set)
    seq_tokens: dict = field(default_factory=dict)


def reference_replay(trace: dict, step: int) -> RefSnapshot:
    """Fold events 0..step, written independently of labkit.engine.trace.replay as a cross-check.
    A block whose ref count drops to 0 stays prefix-cached when it was a full prompt block and
    prefix caching is on (the fixture's `cached` flags say the same); an evict frees it."""
    meta, reqs = trace["meta"], trace["requests"]
    snap = RefSnapshot(free=set(range(meta["num_blocks"])))
    for rec in trace["steps"][: step + 1]:
        for seq_id, toks in rec["outputs"].items():
            snap.seq_tokens.setdefault(seq_id, list(reqs[seq_id]["prompt_token_ids"]))
            snap.seq_tokens[seq_id].extend(toks)
        for ev in rec["events"]:
            p, seq = ev["physical"], ev["seq_id"]
            if ev["type"] in ("alloc", "prefix_hit"):
                snap.free.discard(p)
                snap.cached.discard(p)
                snap.ref_counts[p] = snap.ref_counts.get(p, 0) + 1
                table = snap.block_tables.setdefault(seq, [])
                assert len(table) == ev["logical"], "fixture allocates logical blocks in order"
                table.append(p)
                snap.seq_tokens.setdefault(seq, list(reqs[seq]["prompt_token_ids"]))
            elif ev["type"] == "free":
                snap.ref_counts[p] -= 1
                snap.block_tables[seq].remove(p)
                if not snap.block_tables[seq]:
                    del snap.block_tables[seq]
                if snap.ref_counts[p] == 0:
                    del snap.ref_counts[p]
                    full_prompt = (ev["logical"] + 1) * BS <= reqs[seq]["prompt_len"]
                    if meta["enable_prefix_caching"] and full_prompt:
                        snap.cached.add(p)
                    else:
                        snap.free.add(p)
            elif ev["type"] == "evict":
                snap.cached.discard(p)
                snap.free.add(p)
    return snap


def build_trace() -> dict:
    """The scenario above as a schema-exact trace dict (kv / queues filled by the fold)."""
    prompts = {
        "A": [1, 2, 3, 4, 5, 6],
        "B": [1, 2, 3, 4, 20, 21],
        "C": [30, 31, 32, 33, 34, 35, 36, 37, 38],
        "D": [1, 2, 3, 4, 50],
    }
    arrivals = {"A": 0.0, "B": 0.0, "C": 0.02, "D": 0.03}
    max_tokens = {"A": 3, "B": 2, "C": 2, "D": 2}
    requests = {
        rid: {"prompt_token_ids": p, "prompt_len": len(p), "priority": 0,
              "arrival_time": arrivals[rid], "n": 1, "max_tokens": max_tokens[rid]}
        for rid, p in prompts.items()
    }
    steps = [
        dict(scheduled=[_sched("A", "prefill", 6, 0)], outputs={"A": [7]},
             events=[_ev("alloc", "A", 0, 0), _ev("alloc", "A", 1, 1)]),
        dict(scheduled=[_sched("A", "decode", 1, 6), _sched("B", "prefill", 2, 4)],
             outputs={"A": [8], "B": [22]},
             events=[_ev("prefix_hit", "B", 0, 0), _ev("alloc", "B", 1, 2)]),
        dict(scheduled=[_sched("A", "decode", 1, 7), _sched("B", "decode", 1, 6),
                        _sched("C", "prefill", 5, 0, chunked=True)],
             outputs={"A": [9], "B": [23]},
             finished=[{"request_id": "A", "seq_id": "A", "reason": "length"},
                       {"request_id": "B", "seq_id": "B", "reason": "length"}],
             events=[_ev("alloc", "C", 0, 3), _ev("alloc", "C", 1, 4),
                     _ev("free", "A", 0, 0, cached=True), _ev("free", "A", 1, 1, cached=False),
                     _ev("free", "B", 0, 0, cached=True), _ev("free", "B", 1, 2, cached=False)]),
        dict(scheduled=[_sched("C", "prefill", 4, 5, chunked=True),
                        _sched("D", "prefill", 1, 4)],
             outputs={"C": [40], "D": [51]},
             events=[_ev("alloc", "C", 2, 5), _ev("prefix_hit", "D", 0, 0),
                     _ev("alloc", "D", 1, 6)]),
        dict(scheduled=[_sched("C", "decode", 1, 9)], outputs={"C": [41]},
             preempted=[{"request_id": "D", "seq_id": "D", "mode": "recompute"}],
             finished=[{"request_id": "C", "seq_id": "C", "reason": "length"}],
             events=[_ev("free", "D", 1, 6, cached=False), _ev("free", "D", 0, 0, cached=True),
                     _ev("free", "C", 0, 3, cached=True), _ev("free", "C", 1, 4, cached=True),
                     _ev("free", "C", 2, 5, cached=False)]),
        dict(scheduled=[_sched("D", "prefill", 2, 4)], outputs={"D": [52]},
             events=[_ev("prefix_hit", "D", 0, 0), _ev("evict", "D", 1, 3),
                     _ev("alloc", "D", 1, 3)]),
    ]
    trace = {
        "meta": {"block_size": BS, "num_blocks": 10, "num_cpu_blocks": 0, "executor": "model",
                 "model": "synthetic", "policy": "fcfs", "max_num_seqs": 4,
                 "max_num_batched_tokens": 8, "batching": "continuous",
                 "enable_prefix_caching": True, "watermark_low": 0.01, "watermark_high": 0.05},
        "requests": requests,
        "steps": [],
    }
    for i, s in enumerate(steps):
        rec = {"step": i, "time": 0.01 * i, "duration": 0.01, "scheduled": s["scheduled"],
               "num_batched_tokens": sum(x["num_tokens"] for x in s["scheduled"]),
               "token_budget": 8, "outputs": s["outputs"],
               "preempted": s.get("preempted", []), "finished": s.get("finished", []),
               "events": s["events"], "kv": {}, "queues": {}, "spec": []}
        trace["steps"].append(rec)
        snap = reference_replay(trace, i)
        used = len(snap.ref_counts)
        rec["kv"] = {"used": used, "free": len(snap.free), "cached": len(snap.cached),
                     "total": 10,
                     "token_slots_used": sum(len(snap.seq_tokens[s]) - 1
                                             for s in snap.block_tables)}
        rec["queues"] = {"waiting": 0, "running": len(snap.block_tables), "swapped": 0}
    return trace


def build_spec_trace(gamma: int = 4) -> dict:
    """A decode-only trace where one request drafts `gamma` tokens a step."""
    trace = build_trace()
    accepted = [4, 1, 0, 3, 2, 4]
    for rec, acc in zip(trace["steps"], accepted):
        rec["spec"] = [{"request_id": "A", "seq_id": "A",
                        "proposed": list(range(100, 100 + gamma)), "accepted": min(acc, gamma)}]
    return trace

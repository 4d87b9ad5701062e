"""Read-only views of an engine Trace that the widgets share.

Widgets accept whatever a learner has at hand: a trace dict (the JSON schema in trace.py), a
`Trace`, a `SimResult` or an `LLMEngine` — everything is normalised to the dict once, here. Block
tables at a step come from the engine's own `replay` fold so the picture is exactly what the
block manager did, never a second implementation of it.
"""

from __future__ import annotations

from typing import Any

REQUIRED_KEYS = ("meta", "requests", "steps")

# Gantt states, in the order of their colour codes.
STATES = ("waiting", "prefill", "chunked prefill", "decode", "preempted", "finished")
STATE_COLORS = {
    "waiting": "#d9d9d9",
    "prefill": "#4c78a8",
    "chunked prefill": "#9ecae9",
    "decode": "#54a24b",
    "preempted": "#e45756",
    "finished": "#000000",
}
# Qualitative palette for requests (Plotly's D3 + Set2, enough for a lab-sized trace).
REQUEST_PALETTE = (
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf",
    "#bcbd22", "#66c2a5", "#fc8d62", "#8da0cb", "#e78ac3", "#a6d854", "#ffd92f", "#e5c494",
)
FREE_COLOR = "#eeeeee"
CACHED_COLOR = "#f2cf5b"


def as_trace_dict(trace: Any) -> dict:
    """Normalise a trace-like object to the schema dict; ValueError if it is not one."""
    obj = trace
    if not isinstance(obj, dict) and hasattr(obj, "trace"):  # SimResult, LLMEngine
        obj = obj.trace
    if not isinstance(obj, dict) and hasattr(obj, "to_dict"):
        obj = obj.to_dict()
    if not isinstance(obj, dict):
        raise ValueError(
            f"expected a trace (dict, Trace, SimResult or LLMEngine), got {type(trace).__name__}"
        )
    missing = [k for k in REQUIRED_KEYS if k not in obj]
    if missing:
        raise ValueError(f"trace dict is missing keys {missing}; see labkit.engine.trace")
    if not obj["steps"]:
        raise ValueError("trace has no steps: run the engine (engine.step()) before visualising")
    return obj


def snapshot(trace: dict, step: int) -> Any:
    """Pool state AFTER `step`, from the engine's replay fold."""
    n = len(trace["steps"])
    if not 0 <= step < n:
        raise ValueError(f"step {step} out of range: the trace has steps 0..{n - 1}")
    return _engine_replay()(trace, step)


def peak_step(trace: dict, cached: bool = False) -> int:
    """The first step with the most KV blocks in use (plus prefix-cached ones if ``cached``):
    where a page table has the most to show. The last step is usually the least informative,
    since by then every finished request has freed its blocks."""
    def used(rec: dict) -> int:
        kv = rec.get("kv", {})
        return int(kv.get("used", 0)) + (int(kv.get("cached", 0)) if cached else 0)

    steps = trace["steps"]
    return max(range(len(steps)), key=lambda i: (used(steps[i]), -i))


def _engine_replay():
    from labkit.engine.trace import replay

    return replay


def request_color(trace: dict, groups: dict[str, str] | None = None) -> dict[str, str]:
    """A stable colour per request id (in arrival order); with ``groups`` (request id -> a
    label, e.g. its LoRA adapter), one colour per label instead, so a mixed batch shows which
    adapter each request runs."""
    if groups is None:
        return {rid: REQUEST_PALETTE[i % len(REQUEST_PALETTE)]
                for i, rid in enumerate(trace["requests"])}
    labels = group_colors(groups)
    return {rid: labels[groups[rid]] for rid in trace["requests"] if rid in groups}


def group_colors(groups: dict[str, str]) -> dict[str, str]:
    """A colour per distinct label of ``groups``, in order of first appearance."""
    labels = list(dict.fromkeys(groups.values()))
    return {g: REQUEST_PALETTE[i % len(REQUEST_PALETTE)] for i, g in enumerate(labels)}


def seq_request(seq_id: str) -> str:
    """The request id a seq_id belongs to (`"r"` or `"r:i"` for sample i of n)."""
    return seq_id.rsplit(":", 1)[0] if ":" in seq_id else seq_id


def last_holders(trace: dict, step: int) -> dict[int, tuple[str, int]]:
    """physical block -> (seq_id, logical) that most recently held it, up to `step`.

    Used only to label a free-but-cached block with the tokens it still holds.
    """
    holders: dict[int, tuple[str, int]] = {}
    for rec in trace["steps"][: step + 1]:
        for ev in rec.get("events", ()):
            if ev["type"] in ("alloc", "prefix_hit", "cow", "swap_in"):
                holders[ev["physical"]] = (ev["seq_id"], ev["logical"])
    return holders


def step_end_time(rec: dict) -> float:
    return float(rec["time"]) + float(rec.get("duration", 0.0))


def request_states(trace: dict) -> tuple[list[str], list[list[str | None]]]:
    """Gantt matrix: request ids and, per request, the state at every step (None = absent).

    A request is absent before it arrives and after the step it finished in; between scheduled
    steps it is 'waiting' (or 'preempted' until it is scheduled again after a preemption).
    """
    rids = list(trace["requests"])
    steps = trace["steps"]
    state: dict[str, list[str | None]] = {r: [None] * len(steps) for r in rids}
    preempted: set[str] = set()
    done: set[str] = set()
    started: set[str] = set()
    for i, rec in enumerate(steps):
        t_end = step_end_time(rec)
        sched: dict[str, str] = {}
        for s in rec.get("scheduled", ()):
            rid = s["request_id"]
            phase = s["phase"]
            if phase == "prefill":
                phase = "chunked prefill" if s.get("chunked") else "prefill"
            # prefill wins over decode when samples of one request differ in phase
            if rid not in sched or sched[rid] == "decode":
                sched[rid] = phase
        pre_now = {p["request_id"] for p in rec.get("preempted", ())}
        fin_now = {f["request_id"] for f in rec.get("finished", ())}
        for rid in rids:
            if rid in done:
                continue
            arrival = trace["requests"][rid].get("arrival_time") or 0.0
            if rid in sched:
                state[rid][i] = sched[rid]
                started.add(rid)
                preempted.discard(rid)
            elif rid in pre_now:
                state[rid][i] = "preempted"
            elif rid in preempted:
                state[rid][i] = "preempted"
            elif arrival < t_end or rid in started:
                state[rid][i] = "waiting"
            if rid in pre_now:
                preempted.add(rid)
            if rid in fin_now and not _has_running_sample(trace, rid, steps, i):
                if state[rid][i] is None or state[rid][i] == "waiting":
                    state[rid][i] = "finished"
                done.add(rid)
    return rids, [state[r] for r in rids]


def _has_running_sample(trace: dict, rid: str, steps: list, i: int) -> bool:
    """True while some of a request's n samples have not finished yet (n > 1 requests)."""
    n = int(trace["requests"][rid].get("n") or 1)
    if n == 1:
        return False
    finished = {f["seq_id"] for rec in steps[: i + 1] for f in rec.get("finished", ())
                if f["request_id"] == rid}
    return len(finished) < n


def derive_timings(trace: dict) -> list[dict]:
    """Per-sequence timestamps (the shape engine.request_timings() returns) from a trace.

    A token's time is the end of the step that produced it; arrival comes from the request.
    """
    out: dict[str, dict] = {}
    for rec in trace["steps"]:
        t_start, t_end = float(rec["time"]), step_end_time(rec)
        for s in rec.get("scheduled", ()):
            d = _timing(out, trace, s["request_id"], s["seq_id"])
            if d["first_scheduled_time"] is None:
                d["first_scheduled_time"] = t_start
        for seq_id, toks in rec.get("outputs", {}).items():
            d = _timing(out, trace, seq_request(seq_id), seq_id)
            d["token_times"].extend([t_end] * len(toks))
            if toks and d["first_token_time"] is None:
                d["first_token_time"] = t_end
        for f in rec.get("finished", ()):
            d = _timing(out, trace, f["request_id"], f["seq_id"])
            d["finish_time"] = t_end
            d["finish_reason"] = f.get("reason")
    return list(out.values())


def _timing(out: dict, trace: dict, rid: str, seq_id: str) -> dict:
    if seq_id not in out:
        req = trace["requests"].get(rid, {})
        out[seq_id] = {
            "request_id": rid, "seq_id": seq_id,
            "arrival_time": float(req.get("arrival_time") or 0.0),
            "prompt_len": req.get("prompt_len"),
            "first_scheduled_time": None, "first_token_time": None,
            "token_times": [], "finish_time": None,
        }
    return out[seq_id]

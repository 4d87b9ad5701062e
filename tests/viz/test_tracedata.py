"""Trace views the widgets draw from, checked against the hand-written scenario."""

import pytest

from labkit.viz import tracedata as td
from labkit.viz.memory import memory_series

from .synthetic import build_trace


def test_as_trace_dict_accepts_objects_and_rejects_junk(trace):
    class HasToDict:
        def to_dict(self):
            return trace

    class HasTrace:  # SimResult / LLMEngine shape
        def __init__(self):
            self.trace = HasToDict()

    assert td.as_trace_dict(HasTrace()) is trace
    with pytest.raises(ValueError, match="expected a trace"):
        td.as_trace_dict([1, 2])
    with pytest.raises(ValueError, match="missing keys"):
        td.as_trace_dict({"meta": {}})
    with pytest.raises(ValueError, match="no steps"):
        td.as_trace_dict({"meta": {}, "requests": {}, "steps": []})


def test_snapshot_step_out_of_range(trace):
    with pytest.raises(ValueError, match="out of range"):
        td.snapshot(trace, 6)


def test_request_states_match_the_scenario(trace):
    rids, states = td.request_states(trace)
    assert rids == ["A", "B", "C", "D"]
    assert states == [
        ["prefill", "decode", "decode", None, None, None],
        ["waiting", "prefill", "decode", None, None, None],
        [None, None, "chunked prefill", "chunked prefill", "decode", None],
        [None, None, None, "prefill", "preempted", "prefill"],
    ]


def test_aborted_request_shows_finished_without_running(trace):
    trace["steps"][3]["finished"].append({"request_id": "D", "seq_id": "D", "reason": "abort"})
    trace["steps"][3]["scheduled"] = [s for s in trace["steps"][3]["scheduled"]
                                      if s["request_id"] != "D"]
    _, states = td.request_states(trace)
    assert states[3] == [None, None, None, "finished", None, None]


def test_derive_timings_by_hand(trace):
    t = {d["seq_id"]: d for d in td.derive_timings(trace)}
    # A: tokens produced at the end of steps 0, 1, 2 (each 10 ms long).
    assert t["A"]["token_times"] == pytest.approx([0.01, 0.02, 0.03])
    assert t["A"]["first_token_time"] == pytest.approx(0.01)
    assert t["A"]["finish_time"] == pytest.approx(0.03)
    # C: scheduled at step 2 (first chunk, no token), first token at the end of step 3.
    assert t["C"]["first_scheduled_time"] == pytest.approx(0.02)
    assert t["C"]["first_token_time"] == pytest.approx(0.04)
    assert t["D"]["finish_time"] is None


def test_memory_series_by_hand():
    s = memory_series(build_trace())
    # contiguous reservation = prompt + max_tokens of every request holding KV:
    # step 0 A(6+3); step 1 A+B(6+2); step 2 A+B+C(9+2); step 3 C+D(5+2); step 4 C (D
    # preempted); step 5 D.
    assert s["contiguous"] == [9, 17, 28, 18, 11, 7]
    assert s["paged"] == [8, 12, 8, 20, 0, 8]  # used blocks × block_size 4
    assert s["paged+cached"] == [8, 12, 12, 20, 12, 12]

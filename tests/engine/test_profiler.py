"""The step profiler (issue 31): it sees every phase of a real step, adds up, changes nothing
the engine computes, and leaves the engine exactly as it found it when detached."""

from __future__ import annotations

import json

import pytest

import labkit
from labkit.engine.profiler import LAYER_PARTS, PHASES, StepProfiler

PROMPTS = ["def fib(n):", "import os", "class Stack:"]


@pytest.fixture(scope="module")
def tiny():
    return labkit.load_pretrained("labkit-tiny", dtype="float32")


def _run(llm, n=12):
    sp = labkit.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, sp)]


def test_profiled_output_equals_unprofiled(tiny):
    plain = _run(labkit.LLM.from_model(*tiny))
    llm = labkit.LLM.from_model(*tiny, profile=True)
    assert _run(llm) == plain
    p = llm.profiler
    # 1 prefill step (3 prompts fit one step) + 11 decode steps
    assert len(p.steps) == 12 and [s.index for s in p.steps] == list(range(12))
    assert p.steps[0].num_tokens == sum(len(llm.tokenizer.encode(x)) for x in PROMPTS)
    assert all(s.num_seqs == 3 for s in p.steps) and p.steps[5].num_tokens == 3


def test_phases_are_all_seen_and_add_up_to_the_step(tiny):
    llm = labkit.LLM.from_model(*tiny, profile=True)
    _run(llm)
    for s in llm.profiler.steps:
        assert set(s.phases) == set(PHASES)
        for ph in ("schedule", "prepare", "forward", "sample", "update", "detokenize", "trace"):
            assert s.phases[ph] > 0, (ph, s.index)
        # same run, same clock: "other" is the wall time minus the other phases, so the sum is
        # the wall time up to float rounding (no committed number, no other CPU involved)
        assert sum(s.phases.values()) == pytest.approx(s.wall, rel=1e-6)
        # the parts timed inside the forward are inside it
        assert 0 < sum(s.layers[p] for p in LAYER_PARTS) <= s.phases["forward"]
    summary = llm.profiler.summary()
    assert summary["num_steps"] == 11 and sum(summary["share"].values()) == pytest.approx(1.0)


def test_detach_restores_the_engine_exactly(tiny):
    llm = labkit.LLM.from_model(*tiny)
    eng = llm.llm_engine
    runner = eng.executor.runner
    before = {id(x) for x in (type(eng).step, type(eng.scheduler).schedule)}
    p = StepProfiler().attach(eng)
    assert "step" in vars(eng) and "schedule" in vars(eng.scheduler)
    _run(llm, 2)
    # the model's hooks exist only during a profiled step: none left on the (shared) model
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in runner.model.modules())
    p.detach()
    assert "step" not in vars(eng) and "schedule" not in vars(eng.scheduler)
    assert "forward" not in vars(runner) and "sample" not in vars(runner)
    assert not runner.model._forward_hooks and not runner.model._forward_pre_hooks
    assert not any(m._forward_hooks for m in runner.model.modules())
    assert {id(x) for x in (type(eng).step, type(eng.scheduler).schedule)} == before
    n = len(p.steps)
    _run(llm, 3)
    assert len(p.steps) == n  # a detached profiler records nothing


def test_chrome_trace_nests_layers_inside_forwards_inside_steps(tiny, tmp_path):
    llm = labkit.LLM.from_model(*tiny, profile=True)
    _run(llm, 4)
    path = llm.profiler.export_chrome_trace(tmp_path / "trace.json")
    ev = [e for e in json.loads(path.read_text())["traceEvents"] if e["ph"] == "X"]
    steps = [e for e in ev if e["cat"] == "step"]
    fwd = [e for e in ev if e["name"] == "forward"]
    layers = [e for e in ev if e["cat"] == "layer"]
    assert len(steps) == 4 and len(fwd) == 4
    assert {e["name"] for e in layers} == set(LAYER_PARTS)
    eps = 1.0  # microseconds of float rounding
    for f in fwd:
        assert any(s["ts"] - eps <= f["ts"] and f["ts"] + f["dur"] <= s["ts"] + s["dur"] + eps
                   for s in steps)
    for x in layers:
        assert any(f["ts"] - eps <= x["ts"] and x["ts"] + x["dur"] <= f["ts"] + f["dur"] + eps
                   for f in fwd)


def test_labkit_profile_prints_every_phase_and_writes_a_trace(tmp_path, capsys):
    from labkit.cli import main

    trace = tmp_path / "t.json"
    assert main(["profile", "labkit-tiny", "--batch", "2", "--steps", "4", "--trace",
                 str(trace)]) == 0
    out = capsys.readouterr().out
    assert "batch 2, 3 decode steps" in out
    for p in PHASES:
        assert f"\n{p} " in out
    assert json.loads(trace.read_text())["traceEvents"]
    with pytest.raises(SystemExit):
        main(["profile", "labkit-tiny", "--steps", "1"])
    assert "--steps >= 2" in capsys.readouterr().err


def test_the_phase_table_says_when_the_forward_cannot_be_split():
    """With compiled pieces no module hook runs inside the forward: the table says so instead
    of printing a 0% split; eager (or a compile that fell back) prints the split."""
    from labkit.engine.profile_cli import report

    s = {"model": "m", "batch": 1, "num_steps": 2, "mean_step_ms": 1.0, "cpu_s": 0.002,
         "share": dict.fromkeys(PHASES, 0.1), "phases_s": dict.fromkeys(PHASES, 0.0001),
         "layer_share_of_forward": {"attention": 0.5, "mlp": 0.3, "norm": 0.1, "lm_head": 0.1}}
    assert "attention 50%" in report({**s, "compile": None})
    assert "attention 50%" in report({**s, "compile": "not compiled (no C++ compiler)"})
    compiled = report({**s, "compile": "piecewise inductor: 1 of 1 sizes compiled"})
    assert "no split" in compiled and "attention 50%" not in compiled

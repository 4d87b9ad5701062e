"""The triage lab: each fault, injected into a real server, leaves its signature in the evidence
and no other fault's; the checker accepts the fault and rejects every other answer, citing the
numbers of that run. Every process a run starts is gone after it stops."""

from __future__ import annotations

import pickle
import re

import psutil
import pytest

from labkit.exercises.triage import MODEL, Triage, UnknownFaultError, pick_fault
from labkit.exercises.triage_faults import CHUNK_BUDGET, FAULTS, GC_PER_REQUEST, MEANING
from labkit.serve import faults


# ---- fast: the hook and the pick, no server ------------------------------------------------
def test_fault_env_is_validated(monkeypatch):
    monkeypatch.delenv(faults.FAULT_ENV, raising=False)
    assert faults.active_fault() is None
    monkeypatch.setenv(faults.FAULT_ENV, "gc-storm")
    assert faults.active_fault() == "gc-storm"
    monkeypatch.setenv(faults.FAULT_ENV, "small-kv-pool")  # a flag fault, not the hook's
    with pytest.raises(faults.UnknownFaultError, match="flags"):
        faults.active_fault()


def test_slow_tokenizer_decodes_the_same_and_pickles():
    from labkit.model.loader import open_checkpoint

    tok = open_checkpoint(MODEL)[1]
    slow = pickle.loads(pickle.dumps(faults.SlowTokenizer(tok, 0.001)))
    ids = tok.encode("def fib(n):\n    return n")
    assert slow.decode(ids) == tok.decode(ids)
    assert slow.encode("x = 1") == tok.encode("x = 1")  # everything else is the tokenizer's


def test_pick_is_seeded_and_covers_every_fault():
    assert pick_fault(3) == pick_fault(3)
    assert {pick_fault(s) for s in range(200)} == set(FAULTS)


# ---- slow: one live server per fault ---------------------------------------------------------
def _tree(pid: int) -> list[psutil.Process]:
    p = psutil.Process(pid)
    return [p, *p.children(recursive=True)]


@pytest.fixture(scope="module", params=FAULTS)
def run(request):
    t = Triage(fault=request.param)
    procs = _tree(t.server.pid)
    try:
        yield t
    finally:
        t.stop()
        _, alive = psutil.wait_procs(procs, timeout=10)
        assert not alive, f"{request.param}: still running after stop: {alive}"


@pytest.mark.slow
def test_signature_appears_only_for_its_fault(run):
    fault, m = run.reveal(), run.metrics
    assert run.latency["completed"] + run.latency["failed"] == run.num_requests
    # the raw evidence, read here from its source, not through the checker's signatures
    assert (m["labkit:num_preemptions_total"] > 0) == (fault == "small-kv-pool")
    assert (run.latency["status_counts"].get("429", 0) > 0) == (fault == "low-rate-limit")
    assert (m.get("labkit:request_rejected_total", 0) > 0) == (fault == "low-rate-limit")
    gc_per_request = m["python_gc_collections_total"] / run.num_requests
    assert (gc_per_request > GC_PER_REQUEST) == (fault == "gc-storm")
    hogs = [p for p in _tree(run.server.pid) if faults.HOG_ARG in p.cmdline()]
    assert (len(hogs) > 0) == (fault == "cpu-hog")
    assert all(p.cpu_times().user > 0 for p in hogs)  # spinning, not sleeping
    prof = run.profile()
    assert (prof["max_step_tokens"] > CHUNK_BUDGET) == (fault == "no-chunked-prefill")
    assert (prof["num_preemptions"] > 0) == (fault == "small-kv-pool")
    assert (prof["share"]["detokenize"] > 0.1) == (fault == "slow-tokenizer")
    for f in FAULTS:  # the checker's view agrees
        assert run.evidence(f)[0] == (f == fault), (f, run.evidence(f))


@pytest.mark.slow
def test_checker_accepts_the_fault_and_rejects_every_other(run, capsys):
    fault = run.reveal()
    right = run.check(fault)
    assert right.correct and right.message.startswith(f"✓ {fault}:")
    for wrong in FAULTS:
        if wrong == fault:
            continue
        r = run.check(wrong)
        assert not r.correct
        assert r.message.startswith(f"✗ not {wrong}:") and MEANING[wrong] in r.message
        _cited_numbers_are_real(run, wrong, r.message)
    with pytest.raises(UnknownFaultError, match="not one of"):
        run.check("the network")
    assert run.check(None).correct is False  # not answered: a reminder (strict mode off)
    assert "not answered" in capsys.readouterr().out


def _cited_numbers_are_real(run, wrong: str, message: str) -> None:
    """The number a rejection cites is the run's own, read from its metrics / profile."""
    m = run.metrics
    if wrong == "small-kv-pool":
        assert f"labkit:num_preemptions_total is {m['labkit:num_preemptions_total']:.0f}" \
            in message and m["labkit:num_preemptions_total"] == 0
    elif wrong == "low-rate-limit":
        assert "0 responses with status 429" in message
        assert "request_rejected_total is 0" in message
        assert m.get("labkit:request_rejected_total", 0) == 0
    elif wrong == "gc-storm":
        n = m["python_gc_collections_total"]
        assert f"python_gc_collections_total is {n:.0f}" in message
    elif wrong == "no-chunked-prefill":
        assert f"largest step held {run.profile()['max_step_tokens']} tokens" in message
        assert run.profile()["max_step_tokens"] <= CHUNK_BUDGET
    elif wrong == "slow-tokenizer":
        share = int(re.search(r"detokenize is (\d+)%", message).group(1))
        assert abs(share - 100 * run.profile()["share"]["detokenize"]) <= 1
    elif wrong == "cpu-hog":
        assert "beside the server" in message
        assert not [p for p in run.top if p["role"] == "other"]


# ---- the seams the hook and the flag use -----------------------------------------------------
def test_no_enable_chunked_prefill_flag_prefills_a_long_prompt_in_one_step():
    from labkit.engine.sampling_params import SamplingParams
    from labkit.serve.engine_core import build_engine
    from labkit.serve.launcher import ENGINE_FLAGS, build_parser

    sp = SamplingParams(temperature=0.0, max_tokens=2)
    computed = {}
    for flag in ("--enable-chunked-prefill", "--no-enable-chunked-prefill"):
        args = build_parser().parse_args([MODEL, flag, "--num-blocks", "64"])
        eng, _, _ = build_engine(MODEL, **{k: getattr(args, k) for k in ENGINE_FLAGS})
        eng.add_request("r", None, sp, prompt_token_ids=list(range(5, 605)))
        eng.step()  # the first step: one chunk of the 600-token prompt, or all of it
        computed[flag] = eng.scheduler.running[0].num_computed_tokens
    assert computed == {"--enable-chunked-prefill": CHUNK_BUDGET,
                        "--no-enable-chunked-prefill": 600}
    assert build_parser().parse_args([MODEL]).enable_chunked_prefill is None  # engine default


def test_slow_tokenizer_seam_wraps_only_under_the_fault(monkeypatch):
    from labkit.serve.engine_core import build_engine

    monkeypatch.setenv(faults.FAULT_ENV, "slow-tokenizer")
    eng, tok, _ = build_engine(MODEL, num_blocks=16)
    assert isinstance(tok, faults.SlowTokenizer) and eng.tokenizer is tok
    monkeypatch.delenv(faults.FAULT_ENV)
    assert not isinstance(build_engine(MODEL, num_blocks=16)[1], faults.SlowTokenizer)


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["gc-storm", None])
def test_gc_storm_reaches_the_engine_process(monkeypatch, fault):
    import gc

    from labkit.serve.engine_core import EngineCoreProc, EngineSpec

    if fault:  # the spawned child inherits the environment
        monkeypatch.setenv(faults.FAULT_ENV, fault)
    else:
        monkeypatch.delenv(faults.FAULT_ENV, raising=False)
    core = EngineCoreProc(EngineSpec(MODEL, engine_kw={"num_blocks": 16}))
    try:
        core.send(("call", 1, faults.gc_state))
        assert core.out_conn.poll(60)
        kind, _, err, (threshold, frozen) = core.out_conn.recv()
        assert (kind, err) == ("reply", None)
        if fault:  # every allocation collects, over the whole heap
            assert threshold == (1, 1, 1) and frozen == 0
        else:  # the healthy engine: CPython's thresholds, its startup heap frozen
            assert threshold == gc.get_threshold() != (1, 1, 1) and frozen > 0
    finally:
        assert core.stop() is not None


def test_unknown_fault_stops_labkit_serve_before_its_engine(monkeypatch, capsys):
    from labkit.serve import launcher

    monkeypatch.setenv(faults.FAULT_ENV, "disk-full")
    built = []
    monkeypatch.setattr(launcher, "_engine_core", lambda args: built.append(args))
    with pytest.raises(SystemExit) as e:
        launcher.main([MODEL])
    assert e.value.code == 2 and not built
    assert "LABKIT_FAULT='disk-full'" in capsys.readouterr().err

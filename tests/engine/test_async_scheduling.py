"""``LLM(async_scheduling=True)`` (engine/overlap.py, sched/lookahead.py): step N+1 scheduled
on placeholders by a host thread while N's forward runs. References: the synchronous engine
and ``labkit.model.generate``, token for token; the block pool's counters for leaks."""

from __future__ import annotations

import threading

import pytest

from labkit.config import EngineConfig
from labkit.engine.invariants import assert_no_leaks
from labkit.engine.llm import LLM
from labkit.engine.sampling_params import SamplingParams
from labkit.errors import AsyncSchedulingError, EngineConfigError, EngineStepError
from labkit.sched.lookahead import PLACEHOLDER

MAX_NEW = 10
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)


def both(model, prompts, params=GREEDY, **kw):
    """The same prompts through the synchronous and the async engine: (sync, async, llm)."""
    sync = LLM.from_model(model, None, **kw).generate(prompt_token_ids=prompts,
                                                      sampling_params=params)
    llm = LLM.from_model(model, None, async_scheduling=True, **kw)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert_no_leaks(llm.llm_engine)  # every block free or cached, queues empty
    return sync, outs, llm


def tokens(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


class Recorder:
    """Wraps an engine's executor and scheduler: which sequences each forward ran. With
    ``hold``, each executor call waits, once its forward is done, for the host thread to call
    ``schedule()`` (10 s at most), and counts the steps where it did: that schedule ran while
    the executor call was still in flight. ``on_placeholders`` counts the
    ``schedule()`` calls made while a running sequence's last token was a placeholder."""

    def __init__(self, engine, hold: bool = False):
        self.ran: list[set[str]] = []
        self.scheduled = threading.Event()
        self.overlapped = self.on_placeholders = 0
        execute, sched = engine.executor.execute, engine.scheduler
        schedule = sched.schedule

        def traced_execute(out):
            self.ran.append({sc.seq.seq_id for sc in out.scheduled})
            for sc in out.scheduled:  # what the forward packs is never a placeholder
                assert PLACEHOLDER not in sc.seq.token_ids
            self.scheduled.clear()
            result = execute(out)
            if hold and self.scheduled.wait(timeout=10):
                self.overlapped += 1
            return result

        def traced_schedule():
            self.on_placeholders += any(s.token_ids[-1] == PLACEHOLDER for s in sched.running)
            self.scheduled.set()
            return schedule()

        engine.executor.execute = traced_execute
        sched.schedule = traced_schedule


@pytest.mark.parametrize("kw", [
    {},
    {"block_size": 4, "max_num_batched_tokens": 24, "max_num_seqs": 3},  # chunked prefills
    {"block_size": 16, "enable_prefix_caching": True, "max_num_seqs": 4},
    {"block_size": 5, "enable_chunked_prefill": False, "max_num_seqs": 2},
], ids=["default", "chunked", "prefix-cache", "no-chunking"])
def test_greedy_equals_sync_and_reference(tiny_model, prompts, reference, kw):
    sync, outs, _ = both(tiny_model, prompts, **kw)
    assert tokens(outs) == tokens(sync)
    for p, o in zip(prompts, outs):
        assert o.finished and o.outputs[0].token_ids == reference(p, MAX_NEW, ignore_eos=True)


def test_seeded_samples_and_forks_equal_sync(tiny_model, prompts):
    """n=3 forks sharing the prompt's blocks, seeded sampling: the same random streams."""
    sp = SamplingParams(temperature=0.8, top_k=20, n=3, seed=7, max_tokens=8, ignore_eos=True)
    sync, outs, _ = both(tiny_model, prompts[:4], sp, block_size=4, max_num_seqs=8)
    assert tokens(outs) == tokens(sync)


def test_next_step_is_scheduled_while_the_forward_runs(tiny_model, prompts, reference):
    llm = LLM.from_model(tiny_model, None, async_scheduling=True, block_size=8)
    rec = Recorder(llm.llm_engine, hold=True)
    outs = llm.generate(prompt_token_ids=prompts[:3], sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == \
        [reference(p, MAX_NEW, ignore_eos=True) for p in prompts[:3]]
    # one forward per token (one prompt chunk each), and during every one of them the main
    # thread scheduled the next step, on placeholders for the tokens still being sampled
    assert len(rec.ran) == MAX_NEW
    assert rec.overlapped == rec.on_placeholders == MAX_NEW


@pytest.mark.parametrize("how", ["length", "stop_token"])
def test_a_finished_request_never_runs_again(tiny_model, prompts, reference, how):
    """Requests finishing at different steps (max_tokens 2..6, or a stop token id taken from
    the reference): the extra slot each got in the next step is discarded, never run."""
    ps = prompts[:5]
    if how == "length":
        params = [SamplingParams(temperature=0, max_tokens=2 + i, ignore_eos=True)
                  for i in range(len(ps))]
    else:
        params = [SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True,
                                 stop_token_ids=[reference(p, MAX_NEW, ignore_eos=True)[2 + i]])
                  for i, p in enumerate(ps)]
    sync = LLM.from_model(tiny_model, None, block_size=4).generate(
        prompt_token_ids=ps, sampling_params=params)
    llm = LLM.from_model(tiny_model, None, async_scheduling=True, block_size=4)
    rec = Recorder(llm.llm_engine)
    outs = llm.generate(prompt_token_ids=ps, sampling_params=params)
    assert tokens(outs) == tokens(sync)
    for o in outs:
        ref = reference(o.prompt_token_ids, MAX_NEW, ignore_eos=True)
        c = o.outputs[0]
        assert c.token_ids == ref[:len(c.token_ids)]
        assert c.finish_reason == ("length" if how == "length" else "stop")
        # it ran in exactly one forward per output token (prompt in one chunk): none after
        assert sum(o.request_id in r for r in rec.ran) == len(c.token_ids)
    assert_no_leaks(llm.llm_engine)


def test_stop_string_finishes_and_frees(tmp_path):
    from labkit.model.loader import resolve_model_path

    try:
        resolve_model_path("labkit-tiny")
    except Exception:  # noqa: BLE001
        pytest.skip("datasets/models/labkit-tiny not shipped")
    sync = LLM("labkit-tiny", block_size=16)
    full = sync.generate(["import os\n"], SamplingParams(temperature=0, max_tokens=20))[0]
    stop = full.outputs[0].text[6:9]
    sp = SamplingParams(temperature=0, max_tokens=20, stop=[stop])
    want = sync.generate(["import os\n"], sp)[0].outputs[0]
    llm = LLM("labkit-tiny", block_size=16, async_scheduling=True)
    rec = Recorder(llm.llm_engine)
    got = llm.generate(["import os\n", "def f(x):"], sp)
    c = got[0].outputs[0]
    assert (c.token_ids, c.text, c.finish_reason) == (want.token_ids, want.text, "stop")
    assert len(c.token_ids) < len(full.outputs[0].token_ids)
    assert sum(got[0].request_id in r for r in rec.ran) == len(c.token_ids)
    assert_no_leaks(llm.llm_engine)
    eng, text = llm.llm_engine, ""  # streamed deltas add up to the same text
    eng.add_request("stream", "import os\n", sp)
    while eng.has_unfinished_requests():
        text += "".join(o.text_delta for o in eng.step() if o.request_id == "stream")
    assert text == want.text


def test_abort_between_steps_frees_every_block(tiny_model, prompts, reference):
    llm = LLM.from_model(tiny_model, None, async_scheduling=True, block_size=4)
    eng = llm.llm_engine
    rec = Recorder(eng)
    for i, p in enumerate(prompts[:4]):
        eng.add_request(f"r{i}", None, GREEDY, prompt_token_ids=p)
    for _ in range(4):
        eng.step()
    n_ran = len(rec.ran)
    assert eng.abort("r1")  # it holds a slot in the prepared step
    while eng.has_unfinished_requests():
        eng.step()
    assert all("r1" not in r for r in rec.ran[n_ran:])
    r1 = eng.requests["r1"].seqs[0]
    assert r1.finish_reason == "abort" and PLACEHOLDER not in r1.token_ids
    assert r1.output_token_ids == reference(prompts[1], MAX_NEW, ignore_eos=True)[
        :len(r1.output_token_ids)]
    for i in (0, 2, 3):
        assert eng.requests[f"r{i}"].seqs[0].output_token_ids == \
            reference(prompts[i], MAX_NEW, ignore_eos=True)
    assert_no_leaks(eng)
    # aborting everything mid-generation frees the whole pool at once
    for i, p in enumerate(prompts[:4]):
        eng.add_request(f"s{i}", None, GREEDY, prompt_token_ids=p)
    for _ in range(3):
        eng.step()
    assert eng.block_manager.pool.num_used > 0
    eng.abort([f"s{i}" for i in range(4)])
    assert eng.block_manager.pool.num_used == 0
    while eng.has_unfinished_requests():
        eng.step()
    assert_no_leaks(eng)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_gives_identical_output(tiny_model, prompts, reference, mode):
    kw = {"block_size": 4, "num_blocks": 14, "max_num_seqs": 4, "preemption_mode": mode,
          "num_cpu_blocks": 32 if mode == "swap" else 0}
    sync, outs, llm = both(tiny_model, prompts, **kw)
    assert llm.llm_engine.stats()["num_preemptions"] > 0
    assert tokens(outs) == tokens(sync)
    for p, o in zip(prompts, outs):
        assert o.outputs[0].token_ids == reference(p, MAX_NEW, ignore_eos=True)


def test_failed_forward_aborts_and_frees(tiny_model, prompts):
    llm = LLM.from_model(tiny_model, None, async_scheduling=True, block_size=4)
    eng = llm.llm_engine
    execute, calls = eng.executor.execute, []

    def flaky(out):
        calls.append(1)
        if len(calls) == 4:
            raise RuntimeError("device lost")
        return execute(out)

    eng.executor.execute = flaky
    with pytest.raises(EngineStepError, match="device lost"):
        llm.generate(prompt_token_ids=prompts[:3], sampling_params=GREEDY)
    for r in eng.requests.values():
        assert r.is_finished and all(PLACEHOLDER not in s.token_ids for s in r.seqs)
    assert eng.block_manager.pool.num_used == 0
    late = []  # the step before the failed one was detokenised but not yet returned
    while eng.has_unfinished_requests():
        late += eng.step()
    assert late and {o.request_id for o in late} <= set(eng.requests)
    assert_no_leaks(eng)


@pytest.mark.parametrize("kw", [
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
    {"enable_lora": True},
    {"tensor_parallel_size": 2},
    {"kv_transfer_config": {"kv_connector": "offloading"}},
])
def test_refused_combinations(kw):
    with pytest.raises(AsyncSchedulingError, match="async_scheduling"):
        EngineConfig.from_kwargs(max_position_embeddings=64, async_scheduling=True, **kw)
    EngineConfig.from_kwargs(max_position_embeddings=64, **kw)  # fine without it


def test_bad_value_and_the_simulator_are_refused():
    with pytest.raises(EngineConfigError, match="async_scheduling must be True or False"):
        EngineConfig.from_kwargs(max_position_embeddings=64, async_scheduling="yes")
    from labkit.sim.simulate import simulate

    with pytest.raises(AsyncSchedulingError, match="simulator"):
        simulate(num_requests=2, async_scheduling=True)


@pytest.mark.parametrize("seed,mode,policy", [(0, "recompute", "priority"), (1, "swap", "fcfs"),
                                              (2, "recompute", "fcfs")])
def test_random_workload_replays_and_matches_sync(tiny_model, seed, mode, policy):
    """test_trace_replay's fuzz (random adds, aborts between steps, n=2, seeded sampling,
    priorities, a pool small enough to preempt): the trace rebuilds the live pool after every
    step, nothing leaks, and each request neither engine aborted has the sync engine's tokens."""
    from test_trace_replay import random_workload

    from labkit.engine.llm_engine import LLMEngine

    kw = dict(block_size=3, num_blocks=14, preemption_mode=mode,
              num_cpu_blocks=24 if mode == "swap" else 0, max_num_batched_tokens=16,
              max_num_seqs=6, policy=policy)
    engines = [LLMEngine.from_model(tiny_model, None, async_scheduling=a, **kw)
               for a in (False, True)]
    for eng in engines:
        random_workload(eng, seed, check_every_step=eng.step_loop is not None)
        assert_no_leaks(eng)
    sync, asyn = ({rid: [s.token_ids for s in r.seqs] for rid, r in e.requests.items()
                   if all(s.finish_reason != "abort" for s in r.seqs)} for e in engines)
    common = sorted(set(sync) & set(asyn))
    assert len(common) >= 8 and [sync[r] for r in common] == [asyn[r] for r in common]


def test_logprobs_and_prompt_logprobs_equal_sync(tiny_model, prompts):
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3,
                        prompt_logprobs=2)
    sync, outs, _ = both(tiny_model, prompts[:4], sp, block_size=4,
                         max_num_batched_tokens=16)  # prompts scored over several chunks
    for a, b in zip(sync, outs):
        assert b.outputs[0].token_ids == a.outputs[0].token_ids
        assert len(b.outputs[0].logprobs) == len(b.outputs[0].token_ids)
        assert len(b.prompt_logprobs) == len(b.prompt_token_ids)
        for x, y in zip(a.outputs[0].logprobs + a.prompt_logprobs[1:],
                        b.outputs[0].logprobs + b.prompt_logprobs[1:]):
            assert x.keys() == y.keys()
            for t in x:
                assert y[t].logprob == pytest.approx(x[t].logprob, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("at_launch", [True, False])  # False: the negative control
def test_with_compile_the_host_thread_starts_once_the_forward_is_in_its_graph(
        tiny_model, prompts, reference, monkeypatch, at_launch):
    """compile=True with async scheduling: the host thread schedules the next step while the
    forward is inside its compiled graph (which runs without the GIL), not while the forward
    still runs its Python up to it (engine/overlap.py's module doc). Here that Python is made
    20 ms slow, and so is each graph: every schedule() made during a forward finds it in its
    graph. Started at packing instead (the control), none does."""
    import copy
    import time

    from labkit.engine import overlap, piecewise

    if piecewise.cxx_compiler() is None:
        pytest.skip("no C++ compiler: inductor cannot build CPU kernels here")
    model = copy.deepcopy(tiny_model)  # compile=True changes the model object
    llm = LLM.from_model(model, None, async_scheduling=True, fused=True, compile=True,
                         compile_sizes=(1, 2, 4), block_size=4)
    ps = prompts[:3]
    want = [reference(p, MAX_NEW, ignore_eos=True) for p in ps]
    assert tokens(llm.generate(prompt_token_ids=ps, sampling_params=GREEDY)) == \
        [[w] for w in want]  # every graph built now
    if not at_launch:
        monkeypatch.setattr(overlap.OverlapStepLoop, "_compiled", lambda self: False)
    inside, seen, in_flight = threading.Event(), [], threading.Event()

    def slowly(fn, flag=None):
        def run(*args):
            if flag is not None:
                flag.set()
            time.sleep(0.02)
            try:
                return fn(*args)
            finally:
                if flag is not None:
                    flag.clear()
        return run

    for g in model.forward.graphs.values():
        g.compiled = slowly(g.compiled, inside)
    monkeypatch.setattr(piecewise, "full_graph_args", slowly(piecewise.full_graph_args))
    sched, execute = llm.llm_engine.scheduler, llm.llm_engine.executor.execute
    schedule = sched.schedule

    def traced_execute(out):
        in_flight.set()
        try:
            return execute(out)
        finally:
            in_flight.clear()

    def traced_schedule():
        if in_flight.is_set():
            seen.append(inside.is_set())
        return schedule()

    monkeypatch.setattr(llm.llm_engine.executor, "execute", traced_execute)
    monkeypatch.setattr(sched, "schedule", traced_schedule)
    outs = llm.generate(prompt_token_ids=ps, sampling_params=GREEDY)
    assert tokens(outs) == [[w] for w in want]
    assert_no_leaks(llm.llm_engine)
    assert len(seen) >= MAX_NEW - 2, seen  # the decode steps, each scheduled during a forward
    assert all(seen) if at_launch else not any(seen), seen

"""AsyncLLM: the engine thread, per-request streams, cancel = abort within one step."""

from __future__ import annotations

import asyncio
import sys

import pytest

from labkit.engine.errors import InvalidPromptError
from labkit.engine.invariants import assert_no_leaks
from labkit.engine.llm_engine import LLMEngine
from labkit.engine.sampling_params import SamplingParams
from labkit.model.generate import generate
from labkit.serve.async_llm import AsyncLLM


def _engine(model, **kw):
    return LLMEngine.from_model(model, None, block_size=4, num_blocks=64, **kw)


def _fail_steps_of(eng, request_id):
    """Make every step that schedules ``request_id`` raise inside the executor."""
    real = eng.executor.execute

    def execute(out):
        if any(sc.seq.request_id == request_id for sc in out.scheduled):
            raise RuntimeError("injected kernel failure")
        return real(out)

    eng.executor.execute = execute


async def _collect(stream) -> dict[int, list[int]]:
    toks: dict[int, list[int]] = {}
    async for item in stream:
        assert item.error is None
        for o in item.outputs:
            toks.setdefault(o.index, []).extend(o.new_token_ids)
    return toks


def test_concurrent_streams_equal_reference_and_free_everything(tiny_model):
    prompts = [[1, 2, 3], [5, 6, 7, 8, 9, 10], [11] * 9, [3, 1]]

    async def main():
        llm = AsyncLLM(_engine(tiny_model)).start()
        try:
            streams = [await llm.add_request(f"r{i}", p, SamplingParams(temperature=0,
                                                                        max_tokens=12))
                       for i, p in enumerate(prompts)]
            got = await asyncio.gather(*(_collect(s) for s in streams))
            await llm.call(assert_no_leaks)
            return got
        finally:
            await llm.shutdown()

    got = asyncio.run(main())
    for p, toks in zip(prompts, got):
        assert toks[0] == generate(tiny_model, p, 12)


def test_one_event_loop_wake_up_per_step_not_per_request(tiny_model):
    """Outputs of a step reach the loop in one message (one call_soon_threadsafe): each such
    call writes the loop's self-pipe (a syscall that hands the GIL to the loop thread), so one
    per request per step made the engine thread wait for the GIL that many times a step."""
    prompts = [[1, 2, 3], [5, 6, 7, 8], [11] * 5, [3, 1]]
    steps_with_outputs, posted = [], []

    async def main():
        llm = AsyncLLM(_engine(tiny_model))
        llm.on_step = lambda stats, outs: steps_with_outputs.append(len(outs)) if outs else None
        real = llm._post
        llm._post = lambda msg: (posted.append(msg), real(msg))
        llm.start()
        try:
            streams = [await llm.add_request(f"r{i}", p, SamplingParams(
                temperature=0, max_tokens=8, ignore_eos=True)) for i, p in enumerate(prompts)]
            got = await asyncio.gather(*(_collect(s) for s in streams))
            await llm.call(assert_no_leaks)
            return got
        finally:
            await llm.shutdown()

    got = asyncio.run(main())
    for p, toks in zip(prompts, got):
        assert toks[0] == generate(tiny_model, p, 8)
    steps = [m for m in posted if m[0] == "step" and m[4]]  # the steps that made tokens
    assert len(steps) == len(steps_with_outputs)
    assert sum(steps_with_outputs) == 4 * 8 > len(steps)  # batched: fewer posts than tokens


def test_switch_interval_lowered_while_running_and_restored(tiny_model):
    """While the engine thread runs, a loop thread waiting for the GIL gets it within
    switch_interval, not CPython's 5 ms (which lands on every TTFT); restored at shutdown."""
    before = sys.getswitchinterval()

    async def main():
        llm = AsyncLLM(_engine(tiny_model), switch_interval=before / 10).start()
        try:
            during = sys.getswitchinterval()
            s = await llm.add_request("a", [1, 2], SamplingParams(temperature=0, max_tokens=3))
            toks = await _collect(s)
        finally:
            await llm.shutdown()
        return during, toks

    during, toks = asyncio.run(main())
    assert during == pytest.approx(before / 10) and sys.getswitchinterval() == before
    assert toks[0] == generate(tiny_model, [1, 2], 3)


def test_cancel_aborts_within_one_step_and_frees_blocks(tiny_model):
    async def main():
        eng = _engine(tiny_model)
        llm = AsyncLLM(eng).start()
        try:
            s = await llm.add_request("long", [1, 2, 3, 4, 5], SamplingParams(
                temperature=0, max_tokens=200, ignore_eos=True))
            item = await s.get()
            assert item.outputs and not item.finished
            await s.aclose()
            # call() is queued behind the abort and runs before the next step: were the abort
            # left for later, the blocks of "long" would still be held here
            stats = await llm.call(lambda e: e.stats())
            assert stats["num_used_blocks"] == 0 and stats["num_running"] == 0
            tail = [i async for i in s]
            assert tail == [] or tail[-1].outputs[0].finish_reason == "abort"
            other = await llm.add_request("other", [7, 8], SamplingParams(temperature=0,
                                                                          max_tokens=6))
            toks = await _collect(other)
            await llm.call(assert_no_leaks)
            return toks
        finally:
            await llm.shutdown()

    toks = asyncio.run(main())
    assert toks[0] == generate(tiny_model, [7, 8], 6)


def test_bad_request_raises_at_add_and_engine_goes_on(tiny_model):
    async def main():
        llm = AsyncLLM(_engine(tiny_model)).start()
        try:
            with pytest.raises(InvalidPromptError, match="token ids"):
                await llm.add_request("bad", [1, 999], SamplingParams(max_tokens=2))
            s = await llm.add_request("ok", [1, 2], SamplingParams(temperature=0, max_tokens=3))
            toks = await _collect(s)
            await llm.call(assert_no_leaks)
            return toks
        finally:
            await llm.shutdown()

    assert asyncio.run(main())[0] == generate(tiny_model, [1, 2], 3)


def test_step_failure_fails_only_its_requests(tiny_model):
    eng = _engine(tiny_model, max_num_seqs=1)  # one at a time: the failing step holds only "boom"
    _fail_steps_of(eng, "boom")

    async def main():
        llm = AsyncLLM(eng).start()
        try:
            boom = await llm.add_request("boom", [1, 2], SamplingParams(max_tokens=4))
            ok = await llm.add_request("ok", [3, 4], SamplingParams(temperature=0, max_tokens=4))
            item = await boom.get()
            assert "injected kernel failure" in str(item.error.__cause__)
            toks = await _collect(ok)
            await llm.call(assert_no_leaks)
            assert llm.is_running and llm.num_step_errors == 1
            return toks
        finally:
            await llm.shutdown()

    assert asyncio.run(main())[0] == generate(tiny_model, [3, 4], 4)


def test_shutdown_fails_open_streams(tiny_model):
    async def main():
        llm = AsyncLLM(_engine(tiny_model)).start()
        s = await llm.add_request("r", [1], SamplingParams(max_tokens=200, ignore_eos=True))
        await llm.shutdown()
        items = [i async for i in s]
        assert items and (items[-1].error is not None or items[-1].finished)
        assert not llm.engine.has_unfinished_requests()
        assert_no_leaks(llm.engine)

    asyncio.run(main())


def test_engine_forgets_every_delivered_request(tiny_model):
    """Finished, aborted and failed requests all leave engine.requests once their last output is
    delivered (flat memory), and request_timings() still says how each ended."""
    eng = _engine(tiny_model, max_num_seqs=2)
    _fail_steps_of(eng, "boom")

    async def main():
        llm = AsyncLLM(eng).start()
        try:
            done = [await llm.add_request(f"r{i}", [1 + i, 2], SamplingParams(
                temperature=0, max_tokens=3, n=1 + i % 2)) for i in range(6)]
            await asyncio.gather(*(_collect(s) for s in done))
            cut = await llm.add_request("cut", [4, 5], SamplingParams(max_tokens=200,
                                                                     ignore_eos=True))
            await cut.get()
            await cut.aclose()
            boom = await llm.add_request("boom", [1, 2], SamplingParams(max_tokens=4))
            assert (await boom.get()).error is not None
            held = await llm.call(lambda e: dict(e.requests))
            timings = await llm.call(lambda e: e.request_timings())
            await llm.call(assert_no_leaks)
            return held, timings
        finally:
            await llm.shutdown()

    held, timings = asyncio.run(main())
    assert held == {}
    reasons = {t["request_id"]: t["finish_reason"] for t in timings}
    assert reasons == {**{f"r{i}": "length" for i in range(6)}, "cut": "abort",
                       "boom": "abort"}
    assert len(timings) == 6 + 3 + 2  # one per sample: n = 1, 2, 1, 2, 1, 2


def test_forgetting_can_be_turned_off(tiny_model):
    async def main():
        llm = AsyncLLM(_engine(tiny_model), forget_finished=False).start()
        try:
            await _collect(await llm.add_request("r", [1], SamplingParams(max_tokens=2)))
            return await llm.call(lambda e: list(e.requests))
        finally:
            await llm.shutdown()

    assert asyncio.run(main()) == ["r"]

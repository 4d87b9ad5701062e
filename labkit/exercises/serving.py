"""Exercise 09: the two pieces of a server that fail silently -- a per-key token bucket, and
what a streaming endpoint does when its client leaves.

A wrong token bucket still admits most requests; it fails as a bucket that never refills to
its cap (a burst after a quiet hour), or that charges refused requests (a client that retries
fast locks itself out). A streaming endpoint that does not abort on disconnect still answers
everyone who stays; the ones who leave keep generating into a closed socket and hold their KV
blocks until ``max_tokens``, so under load the pool fills with work nobody reads.

Both checkers compare with the reference on hand-made cases first, then drive the learner's
code through a real server on 127.0.0.1 (the learner's bucket inside ``labkit serve``'s rate
limiter; the learner's stream behind a FastAPI route over ``AsyncLLM``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import threading
import time
from typing import Any

import httpx

from labkit.exercises.checks import CheckFailure, run_check

EXERCISE = "09_serving"


def inject(name: str, learner: Any) -> Any:
    """The reference solution when ``LABKIT_INJECT_SOLUTIONS=1`` (CI), else the learner's."""
    if os.environ.get("LABKIT_INJECT_SOLUTIONS") != "1":
        return learner
    from labkit.exercises import serving_solutions

    return getattr(serving_solutions, name)


def _record() -> bool:
    from labkit.exercises.progress import EXERCISES

    return "token_bucket" in EXERCISES


def _run(coro: Any) -> Any:
    """``asyncio.run`` in a fresh thread: a notebook kernel already runs an event loop."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = asyncio.run(coro)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=target)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box.get("result")


class _Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _same(a: Any, b: float) -> bool:
    return isinstance(a, (int, float)) and (a == b or math.isclose(a, b, rel_tol=1e-9,
                                                                   abs_tol=1e-12))


def _bucket_cases(bucket_cls: Any) -> None:
    from labkit.exercises.serving_solutions import TokenBucket as Ref

    script = [("take", 1), ("take", 1), ("take", 1), ("wait", 0.25), ("take", 1),
              ("wait", 0.25), ("take", 1), ("wait", 100.0), ("take", 2), ("take", 1),
              ("take", 3), ("wait", 0.6), ("take", 1), ("take", 1)]
    rng = random.Random(0)
    for _ in range(60):
        script.append(("wait", rng.choice((0.0, 0.1, 0.37, 1.0))) if rng.random() < 0.4
                      else ("take", rng.choice((1, 1, 2, 0.5))))
    clk_a, clk_b = _Clock(), _Clock()
    mine, ref = bucket_cls(2.0, 2.0, clk_a), Ref(2.0, 2.0, clk_b)
    done = []
    for op, x in script:
        if op == "wait":
            clk_a.t += x
            clk_b.t += x
            done.append(f"wait {x}")
            continue
        want = ref.try_take(x)
        got = mine.try_take(x)
        done.append(f"try_take({x})")
        if not _same(got, want):
            if _same(got, x / 2.0) and want and not math.isinf(want):
                hint = "Retry-After = (cost - tokens) / rate: the tokens already there count"
            elif isinstance(got, (int, float)) and want and got > want:
                hint = "nothing may be taken when a request is refused"
            elif want and not got:
                hint = "refill is capped at burst: tokens = min(burst, tokens + dt * rate)"
            else:
                hint = "0.0 when taken; else (cost - tokens) / rate; inf when cost > burst"
            raise CheckFailure("wrong try_take result", inputs="rate=2, burst=2: "
                               + ", ".join(done[-6:]), expected=want, actual=got, hint=hint)


def _bucket_through_server(bucket_cls: Any) -> str:
    from labkit.engine.llm_engine import LLMEngine
    from labkit.exercises.allocator_engine import tiny_model
    from labkit.serve.api_server import ServeConfig
    from labkit.serve.launcher import ServerThread

    eng = LLMEngine.from_model(tiny_model(), None, block_size=4, num_blocks=64)
    clock = _Clock()  # the server's buckets run on a clock the checker moves: no timing luck
    cfg = ServeConfig(model_name="tiny", api_keys={"k-a": "a", "k-b": "b"}, rate_limit_rps=2.0,
                      bucket=lambda rate, burst, _: bucket_cls(rate, burst, clock))
    body = {"model": "tiny", "prompt": [1, 2, 3], "max_tokens": 1}
    with ServerThread(eng, None, cfg) as srv:
        post = lambda key: httpx.post(srv.url + "/v1/completions", json=body,  # noqa: E731
                                      headers={"Authorization": f"Bearer {key}"}, timeout=30)
        rs = [post("k-a") for _ in range(3)]
        other = post("k-b").status_code
        clock.t += 0.5
        rs.append(post("k-a"))  # half a second later: one token is back
    codes = [r.status_code for r in rs]
    if codes != [200, 200, 429, 200] or other != 200:
        raise CheckFailure("through the server (2 requests/s, burst 2): key a sends 3 at once "
                           "(the 3rd gets 429) and 1 more 0.5 s later; key b has its own bucket",
                           expected=[200, 200, 429, 200, "b: 200"],
                           actual=[*codes, f"b: {other}"])
    if rs[2].headers.get("Retry-After") != "1":
        raise CheckFailure("Retry-After should round the wait (<= 0.5 s here) up to 1 s",
                           expected="1", actual=rs[2].headers.get("Retry-After"))
    return "the server's rate limiter answered 200, 200, 429 (Retry-After: 1) with your bucket"


def check_token_bucket(bucket_cls: Any) -> Any:
    def body() -> str:
        _bucket_cases(bucket_cls)
        return f"exact on 74 takes and waits; {_bucket_through_server(bucket_cls)}."

    return run_check("token_bucket", body, record=_record())


# ---- the streaming endpoint -----------------------------------------------------------------
class _App:
    """A FastAPI app whose POST /stream returns the learner's ``sse_stream(stream)`` as SSE,
    over an AsyncLLM on labkit-tiny, served by uvicorn in a thread on 127.0.0.1."""

    def __init__(self, sse_stream: Any, max_num_seqs: int = 4) -> None:
        import uvicorn
        from fastapi import FastAPI
        from fastapi.responses import StreamingResponse

        from labkit.engine.llm_engine import LLMEngine
        from labkit.engine.sampling_params import SamplingParams
        from labkit.model.loader import load_pretrained
        from labkit.serve.async_llm import AsyncLLM
        from labkit.serve.launcher import free_port

        model, self.tok = load_pretrained("labkit-tiny", dtype="float32")
        self.model = model
        self.engine = LLMEngine.from_model(model, self.tok, block_size=16, num_blocks=128,
                                           max_num_seqs=max_num_seqs)
        self.llm = llm = AsyncLLM(self.engine)

        @contextlib.asynccontextmanager
        async def lifespan(app: Any):
            llm.start()
            yield
            await llm.shutdown()

        app = FastAPI(lifespan=lifespan)
        self.n = 0

        async def stream(request):  # noqa: ANN001, ANN202 - annotated below (local import)
            d = await request.json()
            self.n += 1
            s = await llm.add_request(f"ex-{self.n}", d["prompt"], SamplingParams(
                temperature=0, max_tokens=d["max_tokens"], ignore_eos=True))
            return StreamingResponse(sse_stream(s), media_type="text/event-stream")

        from fastapi import Request
        stream.__annotations__ = {"request": Request}
        app.post("/stream")(stream)

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="error"))
        self.server.install_signal_handlers = lambda: None
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> _App:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.should_exit = True
        self.thread.join(30)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/stream"

    def stats(self) -> dict:
        fut = asyncio.run_coroutine_threadsafe(self.llm.call(lambda e: e.stats()),
                                               self.llm._loop)
        return fut.result(30)

    def finish_reason(self, request_id: str) -> str | None:
        """How the engine finished ``request_id`` ("abort", "length", ...; None: still running)."""
        fut = asyncio.run_coroutine_threadsafe(self.llm.call(lambda e: [
            t["finish_reason"] for t in e.request_timings() if t["request_id"] == request_id]),
            self.llm._loop)
        reasons = fut.result(30)
        return reasons[0] if reasons else None

    def wait_idle(self, seconds: float) -> dict:
        deadline = time.monotonic() + seconds
        while True:
            s = self.stats()
            if s["num_used_blocks"] == 0 and not s["num_running"] and not s["num_waiting"]:
                return s
            if time.monotonic() > deadline:
                return s
            time.sleep(0.02)


def _events(raw: bytes) -> list[str]:
    if not raw.endswith(b"\n\n"):
        raise CheckFailure("every SSE event ends with a blank line: 'data: ...\\n\\n'",
                           expected="...\\n\\n", actual=raw[-20:])
    out = []
    for part in raw.decode().split("\n\n")[:-1]:
        if not part.startswith("data: ") or "\n" in part:
            raise CheckFailure("an SSE event is one line 'data: <payload>' and a blank line",
                               expected="data: {...}", actual=part[:80])
        out.append(part[6:])
    return out


def _stream_cases(app: _App) -> str:
    from labkit.engine.llm import LLM
    from labkit.engine.sampling_params import SamplingParams

    prompt = app.tok.encode("def parse(line):")
    raw = httpx.post(app.url, json={"prompt": prompt, "max_tokens": 24}, timeout=60).content
    events = _events(raw)
    if not events or events[-1] != "[DONE]":
        raise CheckFailure("the stream must end with 'data: [DONE]'", expected="[DONE]",
                           actual=events[-1:] or "(nothing)")
    text = "".join(json.loads(e)["text"] for e in events[:-1])
    want = LLM((app.model, app.tok), num_blocks=64).generate(
        [prompt], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    if text != want.outputs[0].text:
        raise CheckFailure("the streamed text deltas must add up to the whole answer",
                           expected=want.outputs[0].text, actual=text)
    # a client that leaves mid-stream
    long = {"prompt": prompt, "max_tokens": 600}
    with httpx.stream("POST", app.url, json=long, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(2):
            next(lines)
    s = app.wait_idle(3.0)
    reason = app.finish_reason(f"ex-{app.n}")
    if reason not in (None, "abort"):  # ran to the end: fast machines finish 600 tokens in 3 s
        raise CheckFailure("a client left mid-stream, but its request was never aborted: it "
                           "ran to the end with nobody reading", expected="finish reason 'abort'",
                           actual=f"finish reason {reason!r}",
                           hint="abort when the generator is closed or cancelled: "
                                "try/finally with await stream.aclose()")
    if s["num_used_blocks"] or s["num_running"]:
        raise CheckFailure("a client left mid-stream, but 3 s later its request still runs "
                           "and holds KV blocks", expected="0 blocks, 0 running",
                           actual=f"{s['num_used_blocks']} blocks, {s['num_running']} running",
                           hint="abort when the generator is closed or cancelled: "
                                "try/finally with await stream.aclose()")
    return "streamed text equals in-process greedy; a client leaving mid-stream freed its blocks"


def _queued_case(sse_stream: Any) -> str:
    async def main(app: _App) -> None:
        async with httpx.AsyncClient(timeout=60) as c:
            prompt = app.tok.encode("import os")
            async with c.stream("POST", app.url, json={"prompt": prompt,
                                                       "max_tokens": 600}) as a:
                it = a.aiter_lines()
                await it.__anext__()  # A runs (max_num_seqs=1); B will wait behind it
                # B's client gives up while B is queued: a deadline on the whole call (a read
                # timeout would never fire once B streamed)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(c.post(app.url, json={"prompt": prompt,
                                                                 "max_tokens": 600}), 0.3)

    with _App(sse_stream, max_num_seqs=1) as app:
        _run(main(app))
        s = app.wait_idle(6.0)
        from labkit.engine.invariants import assert_no_leaks

        reason = app.finish_reason("ex-2")  # B; a fast machine may run all 600 tokens in 6 s
        if reason not in (None, "abort") or s["num_used_blocks"] or s["num_running"] \
                or s["num_waiting"]:
            raise CheckFailure("a client left while its request was still queued; the request "
                               "was never aborted and ran anyway", expected="idle engine",
                               actual=f"{s['num_running']} running, {s['num_waiting']} "
                                      f"waiting, B's finish reason {reason!r}",
                               hint="the generator is cancelled before its first item: the "
                                    "abort must be in a finally, not after the loop")
        fut = asyncio.run_coroutine_threadsafe(app.llm.call(assert_no_leaks), app.llm._loop)
        fut.result(30)
    return "a client that left while queued was aborted before it ran; nothing leaked"


class _EmptyStream:
    """A finished stream with no outputs: probes a stub before any server starts."""

    def __aiter__(self) -> _EmptyStream:
        return self

    async def __anext__(self) -> Any:
        raise StopAsyncIteration

    async def get(self, timeout: float | None = None) -> Any:
        from labkit.serve.async_llm import StreamItem

        return StreamItem([], finished=True)

    async def aclose(self) -> None:
        return None


async def _probe(sse_stream: Any) -> list:
    return [e async for e in sse_stream(_EmptyStream())]


def check_disconnect(sse_stream: Any) -> Any:
    def body() -> str:
        try:
            _run(_probe(sse_stream))  # a stub raises NotImplementedError here
        except NotImplementedError:
            raise
        except Exception as e:  # noqa: BLE001 - reported as a failed check, not a crash
            raise CheckFailure(f"sse_stream raised {type(e).__name__}: {e} on a request that "
                               "finished with no output", show_values=False) from None
        with _App(sse_stream) as app:
            first = _stream_cases(app)
        return f"{first}; {_queued_case(sse_stream)}."

    return run_check("disconnect_abort", body, record=_record())

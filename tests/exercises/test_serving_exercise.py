"""Exercise 09 (serving): the reference passes both checkers through a real server; each
plausible mistake fails with its own message (negative controls)."""

from __future__ import annotations

import json
import math

import pytest

from labkit.exercises import serving
from labkit.exercises import serving_solutions as S


class NoCap(S.TokenBucket):
    def try_take(self, cost=1.0):
        now = self.clock()
        self.tokens += (now - self.last) * self.rate  # forgets min(burst, ...)
        self.last = now
        if cost > self.burst:
            return math.inf
        if self.tokens >= cost:
            self.tokens -= cost
            return 0.0
        return (cost - self.tokens) / self.rate


class ChargesRefused(S.TokenBucket):
    def try_take(self, cost=1.0):
        wait = super().try_take(cost)
        if wait and not math.isinf(wait):
            self.tokens -= cost  # a refused request still pays
        return wait


class RetryFromEmpty(S.TokenBucket):
    def try_take(self, cost=1.0):
        wait = super().try_take(cost)
        return cost / self.rate if wait and not math.isinf(wait) else wait


async def no_abort(stream):
    async for item in stream:
        for o in item.outputs:
            if o.text_delta:
                yield f"data: {json.dumps({'text': o.text_delta})}\n\n"
    yield "data: [DONE]\n\n"


async def abort_after_loop(stream):
    async for item in stream:
        for o in item.outputs:
            if o.text_delta:
                yield f"data: {json.dumps({'text': o.text_delta})}\n\n"
    yield "data: [DONE]\n\n"
    await stream.aclose()  # never reached when the client leaves


async def abort_once_streaming(stream):
    first = await stream.get()  # waits while queued outside the try: a cancel here leaks
    try:
        for item in [first]:
            for o in item.outputs:
                if o.text_delta:
                    yield f"data: {json.dumps({'text': o.text_delta})}\n\n"
        async for item in stream:
            for o in item.outputs:
                if o.text_delta:
                    yield f"data: {json.dumps({'text': o.text_delta})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        await stream.aclose()


async def no_done(stream):
    try:
        async for item in stream:
            for o in item.outputs:
                if o.text_delta:
                    yield f"data: {json.dumps({'text': o.text_delta})}\n\n"
    finally:
        await stream.aclose()


async def one_newline(stream):
    try:
        async for item in stream:
            for o in item.outputs:
                if o.text_delta:
                    yield f"data: {json.dumps({'text': o.text_delta})}\n"
        yield "data: [DONE]\n\n"
    finally:
        await stream.aclose()


def test_token_bucket_reference_passes():
    r = serving.check_token_bucket(S.TokenBucket)
    assert r.passed, r.message
    assert "429" in r.message


@pytest.mark.parametrize("wrong,needle", [(NoCap, "capped"), (ChargesRefused, "nothing"),
                                          (RetryFromEmpty, "cost - tokens")])
def test_token_bucket_negative_controls(wrong, needle):
    r = serving.check_token_bucket(wrong)
    assert not r.passed and needle in r.message, r.message


@pytest.mark.slow
def test_disconnect_reference_passes():
    r = serving.check_disconnect(S.sse_stream)
    assert r.passed, r.message


@pytest.mark.slow
@pytest.mark.parametrize("wrong,needle", [
    # a fast machine runs the abandoned request to its end within the checker's wait, so the
    # checker asks the engine how each request finished ("abort" vs "length"), not only
    # whether blocks are still held
    (no_abort, "mid-stream"), (abort_after_loop, "mid-stream"),
    (abort_once_streaming, "while its request was still queued"),
    (no_done, "[DONE]"), (one_newline, "blank line")])
def test_disconnect_negative_controls(wrong, needle):
    r = serving.check_disconnect(wrong)
    assert not r.passed and needle in r.message, r.message

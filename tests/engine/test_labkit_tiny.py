"""The shipped checkpoint end to end: text in, text out, streaming deltas, stop strings."""

from __future__ import annotations

import pytest

from labkit.engine.invariants import assert_no_leaks
from labkit.model.loader import resolve_model_path

try:
    resolve_model_path("labkit-tiny")
    HAVE_TINY = True
except Exception:  # noqa: BLE001 - any failure to find it means skip
    HAVE_TINY = False

pytestmark = pytest.mark.skipif(not HAVE_TINY, reason="datasets/models/labkit-tiny not shipped")


@pytest.fixture(scope="module")
def llm():
    import labkit

    return labkit.LLM(model="labkit-tiny", block_size=16, max_num_seqs=8)


def test_text_prompts_match_reference_and_stream(llm):
    from labkit.engine.sampling_params import SamplingParams
    from labkit.model.generate import generate

    prompts = ["def fibonacci(n):", "import os\n", "class Stack:\n    def push(self, x):"]
    sp = SamplingParams(temperature=0, max_tokens=20)
    outs = llm.generate(prompts, sp)
    tok = llm.tokenizer
    for p, o in zip(prompts, outs):
        ref = generate(llm.model, tok.encode(p), 20)
        assert o.prompt == p and o.outputs[0].token_ids == ref
        assert o.outputs[0].text == tok.decode(ref)
    eng = llm.llm_engine
    eng.add_request("stream", prompts[0], sp)
    text = ""
    while eng.has_unfinished_requests():
        for s in eng.step():
            text += s.text_delta
    assert text == outs[0].outputs[0].text


def test_stop_string_cuts_text(llm):
    from labkit.engine.sampling_params import SamplingParams

    full = llm.generate(["import os\n"], SamplingParams(temperature=0, max_tokens=20))[0]
    text = full.outputs[0].text
    stop = text[6:9]
    out = llm.generate(["import os\n"], SamplingParams(temperature=0, max_tokens=20,
                                                      stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.text == text[: text.find(stop)]
    assert len(out.token_ids) < len(full.outputs[0].token_ids)
    assert_no_leaks(llm.llm_engine)


def test_stop_string_at_the_start_leaves_empty_text(llm):
    """The first generated token already holds the stop string: the text is '' (everything
    before it). Before: '' was taken for "not decoded yet" and the stop string came back."""
    from labkit.engine.sampling_params import SamplingParams

    full = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=4))[0]
    first = llm.tokenizer.decode(full.outputs[0].token_ids[:1])
    stop = first[:1]  # e.g. one token decodes to '\\n    '; stop at '\\n'
    out = llm.generate(["def fib(n):"], SamplingParams(temperature=0, max_tokens=4,
                                                       stop=[stop]))[0].outputs[0]
    assert first.startswith(stop) and out.finish_reason == "stop"
    assert out.text == "" and out.token_ids == full.outputs[0].token_ids[:1]
    assert_no_leaks(llm.llm_engine)


def test_stream_never_shows_text_a_stop_string_later_cuts(llm):
    """Streamed deltas hold back the tail that could still become a stop string (vLLM does the
    same), so every prefix of the stream is a prefix of the final text, and they add up to it."""
    from labkit.engine.sampling_params import SamplingParams

    full = llm.generate(["import os\n"], SamplingParams(temperature=0, max_tokens=24))[0]
    text = full.outputs[0].text
    for i, stop in enumerate((text[8:14], text[2:3], "no such stop string")):
        eng = llm.llm_engine
        eng.add_request(f"stream-{i}", "import os\n", SamplingParams(temperature=0, max_tokens=24,
                                                           stop=[stop, "zz"]))
        streamed, final = "", None
        while eng.has_unfinished_requests():
            for out in eng.step():
                streamed += out.text_delta
                want = text[: text.find(stop)] if stop in text else text
                assert want.startswith(streamed), (stop, streamed)  # nothing shown is cut later
                if out.finished:
                    final = out
        assert final is not None and streamed == (text[: text.find(stop)] if stop in text
                                                  else text)
    assert_no_leaks(llm.llm_engine)

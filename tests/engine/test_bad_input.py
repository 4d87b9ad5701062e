"""Every bad input is a ValueError with a message at add_request (or construction)."""

from __future__ import annotations

import pytest

from labkit.engine.llm import LLM
from labkit.engine.llm_engine import LLMEngine
from labkit.engine.sampling_params import SamplingParams


@pytest.fixture()
def engine(tiny_model):
    return LLMEngine.from_model(tiny_model, None, block_size=4, num_blocks=8)


OK = SamplingParams(temperature=0, max_tokens=4)


@pytest.mark.parametrize("prompt,params,match", [
    ([], OK, "empty"),
    ([1] * 256, OK, "context"),  # max_position_embeddings = 256
    ([1] * 20, SamplingParams(max_tokens=40), "never finish"),  # > 8 blocks of 4
    ([999], OK, "token ids"),
    ("text", OK, "tokenizer"),
    ([1, 2], SamplingParams(stop=["x"]), "tokenizer"),
])
def test_bad_requests(engine, prompt, params, match):
    with pytest.raises(ValueError, match=match):
        engine.add_request("r", prompt, params)
    assert not engine.has_unfinished_requests() and "r" not in engine.requests


@pytest.mark.parametrize("kw,match", [
    (dict(max_tokens=0), "max_tokens"), (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(n=0), "n must"),
    (dict(top_k=-2), "top_k"), (dict(stop=["x"], detokenize=False), "detokenize"),
    (dict(stop=[""]), "non-empty"),
])
def test_bad_sampling_params(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_mutated_params_are_checked_at_add_request(engine):
    sp = SamplingParams(max_tokens=4)
    sp.max_tokens = 0
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("r", [1, 2], sp)


def test_duplicate_request_id(engine):
    engine.add_request("r", [1, 2], OK)
    with pytest.raises(ValueError, match="duplicate"):
        engine.add_request("r", [3, 4], OK)


def test_bad_engine_config(tiny_model):
    with pytest.raises(ValueError, match="policy"):
        LLM.from_model(tiny_model, policy="lifo")
    with pytest.raises(ValueError, match="batching"):
        LLM.from_model(tiny_model, batching="dynamic")
    with pytest.raises(ValueError, match="num_cpu_blocks"):
        LLM.from_model(tiny_model, preemption_mode="swap")
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        LLM.from_model(tiny_model, kv_cache_bytes=10)
    with pytest.raises(ValueError, match="watermark"):
        LLM.from_model(tiny_model, watermark_high=0.5, watermark_low=0.9)
    with pytest.raises(ValueError, match="n=4 exceeds"):
        LLM.from_model(tiny_model, max_num_seqs=2).generate(
            prompt_token_ids=[[1]], sampling_params=SamplingParams(n=4))
    with pytest.raises(ValueError, match="chunked prefill"):
        LLM.from_model(tiny_model, enable_chunked_prefill=False, max_num_batched_tokens=8
                       ).generate(prompt_token_ids=[[1] * 6], sampling_params=OK)


def test_speculative_config_without_support(tiny_model, monkeypatch):
    import labkit.spec

    monkeypatch.delattr(labkit.spec, "make_spec_executor", raising=False)
    with pytest.raises(ValueError, match="make_spec_executor"):
        LLM.from_model(tiny_model, speculative_config={"num_speculative_tokens": 3})


def test_failed_generate_leaves_nothing_queued(tiny_model):
    llm = LLM.from_model(tiny_model, block_size=4, num_blocks=8)
    with pytest.raises(ValueError):
        llm.generate(prompt_token_ids=[[1, 2], []], sampling_params=OK)
    assert not llm.llm_engine.has_unfinished_requests()
    assert llm.llm_engine.block_manager.pool.num_used == 0


def test_abort_semantics(engine):
    engine.add_request("a", [1, 2, 3], OK)
    engine.add_request("b", [4, 5, 6], OK)
    engine.step()
    assert engine.abort(["a", "nope"]) is True
    assert engine.abort("a") is False and engine.abort("nope") is False
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.abort("b") is False  # finished already
    assert engine.block_manager.pool.num_used == 0
    reasons = {f["seq_id"]: f["reason"] for s in engine.trace.steps for f in s["finished"]}
    assert reasons == {"a": "abort", "b": "length"}

"""Every bad input is a ValueError with a message at add_request (or construction)."""

from __future__ import annotations

import pytest

from labkit.engine.invariants import assert_no_leaks
from labkit.engine.llm import LLM
from labkit.engine.llm_engine import LLMEngine
from labkit.engine.sampling_params import SamplingParams
from labkit.errors import EngineConfigError, InvalidPromptError, SamplingParamsError


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
    """The engine builds the speculative executor only through a registered factory (it never
    imports labkit.spec); without one it says so at construction."""
    import labkit.engine.executor as executor

    monkeypatch.setattr(executor, "_FACTORIES", {})
    with pytest.raises(EngineConfigError, match="no executor registered for 'speculative'"):
        LLM.from_model(tiny_model, speculative_config={"num_speculative_tokens": 3})


def test_failed_generate_leaves_nothing_queued(tiny_model):
    llm = LLM.from_model(tiny_model, block_size=4, num_blocks=8)
    with pytest.raises(ValueError):
        llm.generate(prompt_token_ids=[[1, 2], []], sampling_params=OK)
    assert not llm.llm_engine.has_unfinished_requests()
    assert_no_leaks(llm.llm_engine)


def test_abort_semantics(engine):
    engine.add_request("a", [1, 2, 3], OK)
    engine.add_request("b", [4, 5, 6], OK)
    engine.step()
    assert engine.abort(["a", "nope"]) is True
    assert engine.abort("a") is False and engine.abort("nope") is False
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.abort("b") is False  # finished already
    assert_no_leaks(engine)
    reasons = {f["seq_id"]: f["reason"] for s in engine.trace.steps for f in s["finished"]}
    assert reasons == {"a": "abort", "b": "length"}


# ---- the audit's cases: types are checked, not coerced; named errors; nothing reaches step() --
@pytest.mark.parametrize("kw,match", [
    (dict(temperature=float("nan")), "temperature"),  # was: RuntimeError inside step()
    (dict(temperature=float("inf")), "temperature"),
    (dict(temperature="1"), "temperature"),  # was: TypeError
    (dict(top_p=float("nan")), "top_p"), (dict(top_p="0.5"), "top_p"),
    (dict(top_k=2.5), "top_k"), (dict(n=True), "n must"), (dict(max_tokens=1.0), "max_tokens"),
    (dict(seed=2**64), "seed"), (dict(seed=1.5), "seed"),
    (dict(n=2, seed=2**64 - 1), "seed"),  # was: overflow inside step() when forking sample 1
    (dict(stop=[1]), "stop strings"), (dict(stop_token_ids=5), "stop_token_ids"),
    (dict(stop_token_ids=["a"]), "stop_token_ids"), (dict(stop_token_ids=[-1]), "stop_token_ids"),
])
def test_bad_sampling_params_named(kw, match):
    with pytest.raises(SamplingParamsError, match=match):
        SamplingParams(**kw)
    assert issubclass(SamplingParamsError, ValueError)


def test_params_must_be_sampling_params(engine):
    with pytest.raises(SamplingParamsError, match="SamplingParams"):
        engine.add_request("r", [1, 2], {"temperature": 0})  # was: AttributeError


def test_sampling_params_edges_that_are_fine():
    assert SamplingParams(seed=-1, n=2).seed == -1
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]


@pytest.mark.parametrize("prompt,kw,match", [
    ([1.7, 2.2], {}, "must be ints"),  # was: silently truncated to [1, 2]
    (["1", "2"], {}, "must be ints"),  # was: silently parsed
    ([True, False], {}, "must be ints"),
    ([[1, 2], [3]], {}, "must be ints"),  # was: TypeError
    (5, {}, "list of token ids"), ({1: 2}, {}, "list of token ids"),
    ([1, 2], dict(cache_salt=123), "cache_salt"),  # was: AttributeError inside step()
    ([1, 2], dict(arrival_time=float("nan")), "arrival_time"),
    ([1, 2], dict(arrival_time=1.7e9), "epoch"),  # was: step() slept for 54 years
    ([1, 2], dict(params=SamplingParams(stop_token_ids=[128])), "outside the vocabulary"),
    ([1, 2], dict(request_id=None), "request_id"),  # was: accepted as "None"
])
def test_bad_prompts_named(engine, prompt, kw, match):
    kw = {"request_id": "r", "params": OK, **kw}
    with pytest.raises(InvalidPromptError, match=match):
        engine.add_request(kw.pop("request_id"), prompt, kw.pop("params"), **kw)
    assert not engine.has_unfinished_requests() and not engine.requests
    assert_no_leaks(engine)


def test_token_id_containers_accepted(engine, reference):
    import numpy as np
    import torch

    for i, p in enumerate([(3, 4, 5), torch.tensor([3, 4, 5]), np.array([3, 4, 5]), range(3, 6)]):
        engine.add_request(f"r{i}", p, OK)
    while engine.has_unfinished_requests():
        engine.step()
    want = reference([3, 4, 5], 4)
    assert all(r.seqs[0].output_token_ids == want for r in engine.requests.values())
    assert_no_leaks(engine)


@pytest.mark.parametrize("kw,match", [
    (dict(block_size=0), "block_size"),  # was: ZeroDivisionError
    (dict(block_size=2.5), "block_size"), (dict(num_blocks=-1), "num_blocks"),
    (dict(num_blocks=2.5), "num_blocks"), (dict(num_cpu_blocks=-1), "num_cpu_blocks"),
    (dict(max_num_seqs=0), "max_num_seqs"), (dict(max_num_seqs=2.5), "max_num_seqs"),
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),
    (dict(max_model_len=1000), "max_position_embeddings"),  # was: model error mid-step
    (dict(max_model_len=0), "max_model_len"),
    (dict(preemption_mode="lifo"), "preemption_mode"), (dict(attention_backend="cuda"), "backend"),
    (dict(kv_cache_dtype="fp4"), "kv_cache_dtype"), (dict(policy="lifo"), "policy"),
])
def test_bad_engine_config_named(tiny_model, kw, match):
    with pytest.raises(EngineConfigError, match=match):
        LLMEngine.from_model(tiny_model, None, **kw)


def test_generate_prompt_token_id_shapes(tiny_model, reference):
    llm = LLM.from_model(tiny_model, block_size=4, num_blocks=16)
    out = llm.generate(prompt_token_ids=[3, 4, 5], sampling_params=OK)  # one flat prompt
    assert len(out) == 1 and out[0].outputs[0].token_ids == reference([3, 4, 5], 4)
    with pytest.raises(InvalidPromptError, match="prompt_token_ids"):
        llm.generate([3, 4, 5], OK)  # ints as "prompts": ambiguous, was a TypeError
    with pytest.raises(InvalidPromptError, match="not both"):
        llm.generate(["a"], OK, prompt_token_ids=[[1]])
    with pytest.raises(InvalidPromptError, match="priorities"):
        llm.generate(prompt_token_ids=[[1], [2]], sampling_params=OK, priority=[0])
    assert_no_leaks(llm.llm_engine)


def test_llm_dtype_string_applies_to_a_model_object(tiny_model):
    import copy

    import torch

    llm = LLM.from_model(copy.deepcopy(tiny_model), dtype="bfloat16", block_size=4,
                         num_blocks=8)  # was: silently stayed float32
    assert llm.model.dtype == torch.bfloat16
    with pytest.raises(EngineConfigError, match="dtype"):
        LLM.from_model(tiny_model, dtype="fp8")

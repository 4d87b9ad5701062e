"""Structured outputs through the engine (xgrammar): the output obeys its constraint, the
constraint really changes it, and unconstrained neighbours in the same batch are untouched."""

from __future__ import annotations

import json
import re
import sys

import pytest

from labkit.engine.invariants import assert_no_leaks
from labkit.engine.llm import LLM
from labkit.engine.sampling_params import SamplingParams, StructuredOutputsParams
from labkit.errors import SamplingParamsError, StructuredOutputsError

pytest.importorskip("xgrammar", reason="structured outputs need the optional xgrammar "
                                       "(pip install labkit[structured])")

PROMPT = "def fib(n):"  # code: labkit-tiny never writes JSON here unprompted (negative control)
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer"}, "ok": {"type": "boolean"}},
          "required": ["name", "age", "ok"], "additionalProperties": False}
REGEX = r"[a-z]{3,8}@[a-z]{3,8}\.com"
CHOICES = ["yes", "no", "maybe later"]


def validate(obj: object, schema: dict) -> None:
    """jsonschema when installed, else the required keys and their types by hand."""
    try:
        import jsonschema
    except ImportError:
        types = {"string": str, "integer": int, "boolean": bool}
        assert isinstance(obj, dict) and set(obj) == set(schema["required"])
        for k, spec in schema["properties"].items():
            assert isinstance(obj[k], types[spec["type"]])
        return
    jsonschema.validate(obj, schema)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("labkit-tiny", block_size=4)


def run(llm: LLM, so: StructuredOutputsParams | None, **kw) -> list:
    kw.setdefault("temperature", 0)
    kw.setdefault("max_tokens", 48)
    out = llm.generate([PROMPT], SamplingParams(structured_outputs=so, **kw), use_tqdm=False)
    return out[0].outputs


@pytest.mark.parametrize("compact", [False, True])
def test_json_schema_output_validates_and_stops_at_the_grammar_end(llm, compact):
    o = run(llm, StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=compact))[0]
    validate(json.loads(o.text), SCHEMA)
    assert o.finish_reason == "stop"  # EOS was the only token left once the object closed
    assert o.token_ids[-1] in llm.llm_engine.config.model.eos_token_ids


def test_without_the_constraint_the_same_prompt_is_not_json(llm):
    text = run(llm, None)[0].text
    with pytest.raises(ValueError):
        json.loads(text)


def test_schema_as_a_string_and_json_object(llm):
    o = run(llm, StructuredOutputsParams(json=json.dumps(SCHEMA), disable_any_whitespace=True))
    validate(json.loads(o[0].text), SCHEMA)
    o = run(llm, StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
            max_tokens=64)[0]
    if o.finish_reason == "stop":  # a free-form object may not close within max_tokens
        assert isinstance(json.loads(o.text), dict)
    else:
        assert o.text.startswith("{")


def test_regex_choice_and_grammar(llm):
    o = run(llm, StructuredOutputsParams(regex=REGEX))[0]
    assert re.fullmatch(REGEX, o.text), o.text
    assert run(llm, StructuredOutputsParams(choice=CHOICES))[0].text in CHOICES
    ebnf = 'root ::= num " + " num\nnum ::= [1-9] [0-9]?'
    o = run(llm, StructuredOutputsParams(grammar=ebnf))[0]
    assert re.fullmatch(r"[1-9][0-9]? \+ [1-9][0-9]?", o.text), o.text


def test_mask_applies_before_sampling_seeded_samples_validate(llm):
    """Sampled (not greedy) rows, n=2 forks of one prompt row, several seeds: every sample is
    valid, so the mask is on the distribution sampled from, per sequence."""
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    for seed in range(3):
        outs = run(llm, so, temperature=1.0, top_p=0.95, seed=seed, n=2, max_tokens=64)
        for o in outs:
            if o.finish_reason == "stop":
                validate(json.loads(o.text), SCHEMA)
            else:  # ran out of tokens inside a long string: still a valid prefix
                assert o.text.startswith('{"name":"')
    assert any(o.finish_reason == "stop" for o in outs)


def test_mixed_batch_leaves_free_rows_identical(llm):
    ref = run(llm, None)[0].token_ids
    so = SamplingParams(temperature=0, max_tokens=48,
                        structured_outputs=StructuredOutputsParams(choice=CHOICES))
    free = SamplingParams(temperature=0, max_tokens=48)
    outs = llm.generate([PROMPT, PROMPT, "import os\n"], [so, free, so], use_tqdm=False)
    assert outs[1].outputs[0].token_ids == ref
    assert outs[0].outputs[0].text in CHOICES and outs[2].outputs[0].text in CHOICES
    assert_no_leaks(llm.llm_engine)


def test_logprobs_are_of_the_masked_distribution(llm):
    o = run(llm, StructuredOutputsParams(choice=CHOICES), logprobs=3)[0]
    first = o.logprobs[0]
    finite = [t for t, lp in first.items() if lp.logprob > float("-inf")]
    assert o.token_ids[0] in finite
    for t in finite:  # every token with probability left starts some choice
        assert any(c.startswith(llm.tokenizer.decode([t])) for c in CHOICES)
    assert all(lp.logprob <= 0 for lp in first.values())


@pytest.mark.parametrize("bad, match", [
    ({"json": "{not json"}, "invalid structured_outputs.json"),
    ({"regex": "[a-"}, "invalid structured_outputs.regex"),
    ({"grammar": "root ::= undefined_rule"}, "invalid structured_outputs.grammar"),
])
def test_invalid_constraint_is_a_named_error_at_add_request(llm, bad, match):
    with pytest.raises(StructuredOutputsError, match=re.escape(match)):
        llm.llm_engine.add_request("bad", PROMPT, SamplingParams(
            structured_outputs=StructuredOutputsParams(**bad)))
    assert "bad" not in llm.llm_engine.requests


@pytest.mark.parametrize("kw", [{}, {"json": {}, "regex": "a"}, {"choice": []},
                                {"choice": ["a", 1]}, {"json_object": False}])
def test_exactly_one_well_typed_constraint(kw):
    with pytest.raises(SamplingParamsError):
        StructuredOutputsParams(**kw)
    with pytest.raises(StructuredOutputsError, match="unexpected keyword"):
        SamplingParams(structured_outputs={"jsonn": {}})


def test_dict_is_accepted_as_vllm_json_body():
    sp = SamplingParams(structured_outputs={"regex": "a+"})
    assert sp.structured_outputs == StructuredOutputsParams(regex="a+")


@pytest.mark.parametrize("spec", [
    {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3},
    {"method": "draft_model", "model": "labkit-tiny", "num_speculative_tokens": 3}])
def test_speculative_decoding_keeps_the_constraint(llm, spec, monkeypatch):
    """Speculation under a grammar: each verify row is masked in the grammar state after the
    drafts before it, so greedy output equals the unspeculated constrained output token for
    token; drafts the grammar rejects are cut (and rejected), and some drafts are accepted."""
    from labkit.engine.structured_output import GrammarLogitsProcessor

    seen: list[tuple[int, int]] = []   # (drafts, drafts the grammar accepted) per verify
    real = GrammarLogitsProcessor.mask_draft_rows

    def spy(self, logits, drafts):
        rows, n = real(self, logits, drafts)
        seen.append((len(drafts), n))
        return rows, n

    monkeypatch.setattr(GrammarLogitsProcessor, "mask_draft_rows", spy)
    fast = LLM((llm.model, llm.tokenizer), block_size=4, speculative_config=spec)
    prompts = [PROMPT, 'person = {"name": "Ann", "age": 41, "ok": true}\nperson = ']
    sos = [StructuredOutputsParams(json=SCHEMA), StructuredOutputsParams(regex=REGEX),
           StructuredOutputsParams(choice=CHOICES)]
    for so in sos:
        sp = SamplingParams(temperature=0, max_tokens=48, structured_outputs=so)
        want = llm.generate(prompts, sp, use_tqdm=False)
        got = fast.generate(prompts, sp, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert any(n < d for d, n in seen), "no draft was ever cut by the grammar"
    assert fast.llm_engine.executor.num_accepted_tokens > 0
    assert_no_leaks(fast.llm_engine)


def test_missing_xgrammar_says_how_to_install(llm, monkeypatch):
    from labkit.engine.structured_output import StructuredOutputManager

    monkeypatch.setitem(sys.modules, "xgrammar", None)  # import xgrammar -> ImportError
    mgr = StructuredOutputManager(llm.tokenizer, 4096, (0,))
    with pytest.raises(StructuredOutputsError, match=re.escape("pip install labkit[structured]")):
        mgr.compile(StructuredOutputsParams(regex="a+"))


def test_compiled_grammars_are_cached(llm):
    mgr = llm.llm_engine.structured_output_manager
    a = mgr.compile(StructuredOutputsParams(json=SCHEMA))
    b = mgr.compile(StructuredOutputsParams(json=json.loads(json.dumps(SCHEMA))))
    assert a is b


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_and_chunked_prefill_keep_the_grammar_state(llm, mode):
    """A pool too small for the batch (sequences preempted and resumed) and 4-token prefill
    chunks: each sequence's matcher lives with it, so the outputs equal the roomy run's."""
    prompts = [PROMPT, "import os\n", "class Stack:\n    def push(self, x):", "# a test\n"]
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    sp = SamplingParams(temperature=0, max_tokens=40, structured_outputs=so)
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, sp)]
    tight = LLM((llm.model, llm.tokenizer), block_size=4, num_blocks=24, num_cpu_blocks=24,
                preemption_mode=mode, max_num_batched_tokens=4)
    got = tight.generate(prompts, sp)
    assert tight.llm_engine.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in got] == want
    for o in got:
        if o.outputs[0].finish_reason == "stop":
            validate(json.loads(o.outputs[0].text), SCHEMA)
    assert_no_leaks(tight.llm_engine)


def test_ignore_eos_after_the_grammar_end_keeps_the_text(llm):
    """With ignore_eos the sequence outlives its grammar: only EOS stays allowed (no text)."""
    so = StructuredOutputsParams(choice=CHOICES)
    o = run(llm, so, ignore_eos=True, max_tokens=8)[0]
    assert o.finish_reason == "length" and o.text in CHOICES

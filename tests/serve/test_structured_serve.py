"""Structured outputs through the real server: OpenAI's ``response_format`` (json_object,
json_schema), vLLM's ``structured_outputs`` object and ``guided_*`` extras, on completions and
chat; every bad constraint is a 400 with OpenAI's error body naming the field."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from serve_helpers import NAME, sse_events

from labkit.engine.llm import LLM
from labkit.engine.llm_engine import LLMEngine
from labkit.engine.sampling_params import SamplingParams, StructuredOutputsParams
from labkit.serve.api_server import ServeConfig
from labkit.serve.launcher import ServerThread

pytest.importorskip("xgrammar", reason="structured outputs need the optional xgrammar "
                                       "(pip install labkit[structured])")

PROMPT = "def fib(n):"
SCHEMA = {"type": "object",
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
CHOICES = ["red", "green", "blue"]
REGEX = r"[0-9]{3}-[0-9]{4}"
CHAT = [{"role": "user", "content": "Describe a person."}]


def validate(obj: object) -> None:
    try:
        import jsonschema
    except ImportError:
        assert isinstance(obj, dict) and set(obj) == {"name", "age"}
        assert isinstance(obj["name"], str) and isinstance(obj["age"], int)
        return
    jsonschema.validate(obj, SCHEMA)


@pytest.fixture(scope="module")
def server(labkit_tiny):
    m, tok = labkit_tiny
    eng = LLMEngine.from_model(m, tok, block_size=16, num_blocks=128, max_num_seqs=8)
    with ServerThread(eng, tok, ServeConfig(model_name=NAME)) as srv:
        yield srv


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": NAME, "temperature": 0,
                                                "max_tokens": 48, **body}, timeout=60)


def text(server, path: str, body: dict) -> str:
    r = post(server, path, body)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    return c["message"]["content"] if path.endswith("chat/completions") else c["text"]


JSON_SCHEMA_RF = {"type": "json_schema",
                  "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}


@pytest.mark.parametrize("path, prompt", [("/v1/completions", {"prompt": PROMPT}),
                                          ("/v1/chat/completions", {"messages": CHAT})])
def test_response_format_json_schema_validates(server, path, prompt):
    validate(json.loads(text(server, path, {**prompt, "response_format": JSON_SCHEMA_RF})))


def test_json_object_and_text(server):
    body = {"prompt": PROMPT, "max_tokens": 64,
            "structured_outputs": {"json_object": True, "disable_any_whitespace": True}}
    out = text(server, "/v1/completions", body)
    assert out.startswith("{")
    r = post(server, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4,
                                              "response_format": {"type": "json_object"}})
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"][:1] in "{"
    free = text(server, "/v1/completions", {"prompt": PROMPT})  # negative control: not JSON
    assert text(server, "/v1/completions", {"prompt": PROMPT,
                                            "response_format": {"type": "text"}}) == free
    with pytest.raises(ValueError):
        json.loads(free)


@pytest.mark.parametrize("path, prompt", [("/v1/completions", {"prompt": PROMPT}),
                                          ("/v1/chat/completions", {"messages": CHAT})])
def test_guided_extras_and_structured_outputs(server, path, prompt):
    assert re.fullmatch(REGEX, text(server, path, {**prompt, "guided_regex": REGEX}))
    assert text(server, path, {**prompt, "guided_choice": CHOICES}) in CHOICES
    validate(json.loads(text(server, path, {**prompt, "guided_json": SCHEMA,
                                            "guided_decoding_backend": "xgrammar"})))
    so = {"choice": CHOICES}
    assert text(server, path, {**prompt, "structured_outputs": so}) in CHOICES


def test_server_equals_the_python_api(server, labkit_tiny):
    llm = LLM(labkit_tiny, num_blocks=64)
    sp = SamplingParams(temperature=0, max_tokens=48,
                        structured_outputs=StructuredOutputsParams(json=SCHEMA))
    want = llm.generate([PROMPT], sp)[0].outputs[0].text
    assert text(server, "/v1/completions", {"prompt": PROMPT, "guided_json": SCHEMA}) == want


def test_streamed_json_schema(server):
    r = post(server, "/v1/completions", {"prompt": PROMPT, "stream": True,
                                         "response_format": JSON_SCHEMA_RF})
    assert r.status_code == 200
    events = [json.loads(e) for e in sse_events(r.content)[:-1]]
    validate(json.loads("".join(e["choices"][0]["text"] for e in events if e["choices"])))


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
    ({"response_format": {"type": "json_schema",
                          "json_schema": {"schema": {"type": "nope"}}}}, "response_format"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "[a-"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_regex": "a", "guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
])
def test_bad_constraint_is_a_400_naming_the_field(server, body, param):
    r = post(server, "/v1/completions", {"prompt": PROMPT, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["param"] == param, err
    assert err["message"]


def test_missing_xgrammar_is_a_400_saying_how_to_install(server, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "xgrammar" else real(name, *a))
    r = post(server, "/v1/completions", {"prompt": PROMPT, "guided_regex": "a+"})
    assert r.status_code == 400
    assert "pip install labkit[structured]" in r.json()["error"]["message"]


def test_openai_sdk_parse_helper(server):
    """The openai SDK's own structured-output helper: ``chat.completions.parse`` turns a pydantic
    model into a strict ``json_schema`` response_format and parses the reply back into it."""
    from openai import OpenAI
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=12)
        age: int

    client = OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=60)
    done = client.chat.completions.parse(model=NAME, messages=CHAT, response_format=Person,
                                         temperature=0, max_tokens=48)
    msg = done.choices[0].message
    assert isinstance(msg.parsed, Person), msg
    assert Person.model_validate_json(msg.content) == msg.parsed
    # and the logprobs helper fields come back typed too
    lp = client.chat.completions.create(model=NAME, messages=CHAT, temperature=0, max_tokens=4,
                                        logprobs=True, top_logprobs=2)
    content = lp.choices[0].logprobs.content
    assert len(content) == lp.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.top_logprobs[1].logprob
               and t.logprob <= 0 for t in content)
    # greedy: the sampled token is the most likely one
    assert all(t.token == t.top_logprobs[0].token for t in content)

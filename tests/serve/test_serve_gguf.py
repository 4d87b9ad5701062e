"""``labkit serve FILE.gguf``: the server runs on a GGUF file (as ``labkit bench serve-llamacpp``
starts it beside llama.cpp) and answers exactly as on the model folder the file came from."""

from __future__ import annotations

import httpx
import pytest
from serve_helpers import NAME, idle

from labkit.engine.llm import LLM
from labkit.engine.sampling_params import SamplingParams
from labkit.serve.api_server import ServeConfig
from labkit.serve.launcher import ServerThread, build_engine

pytest.importorskip("gguf")


@pytest.mark.slow
def test_server_on_a_gguf_file_equals_the_folder(tmp_path, labkit_tiny):
    from labkit.quant.gguf_export import export_gguf

    m, tok = labkit_tiny
    path = tmp_path / "tiny-f32.gguf"
    export_gguf(m, path, type="f32", tokenizer=tok, progress=False)
    eng, gtok, render = build_engine(str(path), dtype="float32", num_blocks=64)
    assert render([{"role": "user", "content": "hi"}]).startswith("<|im_start|>")  # default
    prompts = ["def add(a, b):", "import os\n"]
    with ServerThread(eng, gtok, ServeConfig(model_name=NAME)) as srv:
        r = httpx.post(srv.url + "/v1/completions", json={
            "model": NAME, "prompt": prompts, "max_tokens": 12, "temperature": 0,
            "return_token_ids": True}, timeout=60)
        idle(srv)
    assert r.status_code == 200, r.text
    want = LLM(labkit_tiny, num_blocks=64).generate(
        prompts, SamplingParams(temperature=0, max_tokens=12))
    got = [c["token_ids"] for c in r.json()["choices"]]
    assert got == [w.outputs[0].token_ids for w in want]

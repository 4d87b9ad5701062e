"""``labkit serve --fused --compile --async-scheduling``: the flags reach the engine the server
builds (the model fused and compiled in place, the engine's step loop the overlapping one),
and a served greedy completion equals the default server's; impossible combinations are
refused at start, before anything loads."""

from __future__ import annotations

import httpx
import pytest
from serve_helpers import NAME

from labkit.engine.overlap import OverlapStepLoop
from labkit.serve.api_server import ServeConfig
from labkit.serve.engine_core import build_engine
from labkit.serve.engine_flags import check_features
from labkit.serve.launcher import ENGINE_FLAGS, ServerThread, build_parser

BASE = ["labkit-tiny", "--engine-mode", "thread", "--num-blocks", "64", "--max-num-seqs", "4"]
PROMPTS = ["def fib(n):", "import os\n"]


def served(flags: list[str]) -> tuple[list[str], object]:
    """Build the engine as `labkit serve BASE + flags` does; two greedy completions, sent
    together (one batch)."""
    args = build_parser().parse_args(BASE + flags)
    kw = {k: getattr(args, k) for k in ENGINE_FLAGS}
    eng, tok, _ = build_engine(args.model, dtype=args.dtype, device=args.device, **kw)
    body = {"model": NAME, "prompt": PROMPTS, "max_tokens": 12, "temperature": 0}
    with ServerThread(eng, tok, ServeConfig(model_name=NAME)) as srv:
        r = httpx.post(srv.url + "/v1/completions", timeout=300, json=body)
    assert r.status_code == 200, r.text
    choices = sorted(r.json()["choices"], key=lambda c: c["index"])
    return [c["text"] for c in choices], eng


def test_fused_and_async_scheduling_equal_the_default_server():
    want, plain = served([])
    got, eng = served(["--fused", "--async-scheduling"])
    assert got == want and all(want)
    assert plain.step_loop is None and isinstance(eng.step_loop, OverlapStepLoop)
    layers = eng.executor.model.model.layers
    assert all(hasattr(la.self_attn, "qkv_proj") for la in layers)  # fused in place


def test_compile_flag_reaches_the_engine_settings():
    """``--compile`` travels the same path as ``--fused`` (tested served above); compiling in a
    server costs two inductor compiles, so its equality is tested on ``LLM(compile=True)``
    (tests/engine/test_step_cures.py)."""
    from labkit.serve.engine_flags import features_of

    args = build_parser().parse_args([NAME, "--fused", "--compile", "--async-scheduling"])
    assert {k: features_of(args)[k] for k in ("fused", "compile", "async_scheduling")} == \
        {"fused": True, "compile": True, "async_scheduling": True}
    assert "compile" not in features_of(build_parser().parse_args([NAME]))


@pytest.mark.parametrize("kw, match", [
    ({"compile": True, "tensor_parallel_size": 2}, "tensor-parallel"),
    ({"fused": True, "tensor_parallel_size": 2}, "tensor-parallel"),
    ({"compile": True, "enable_lora": True}, "enable_lora"),
])
def test_impossible_combinations_are_refused_before_loading(kw, match):
    with pytest.raises(ValueError, match=match):
        check_features("labkit-tiny", kw)

"""Start-up stays lean: a fresh process that imports labkit, loads labkit-tiny and generates
a token must not have imported what local CPU generation does not need (each of these once
cost a new process a tenth of a second to half a second: ``labkit bench step``'s start-up
breakdown). A behavioural check, not a timing: it fails when someone re-adds an eager import.
Also: the two load-path shortcuts give what the slow paths gave."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from labkit.kv.cache import pool_zeros
from labkit.model.loader import models_dir
from labkit.model.meta import empty_model, materialize
from labkit.model.testing import tiny_model

# sympy arrives with torch.fx.experimental.symbolic_shapes, which Module.to_empty on meta
# tensors imports (labkit.model.meta.materialize avoids it); the rest are optional extras
MUST_STAY_OUT = ("sympy", "torch.fx.experimental.symbolic_shapes", "torch._dynamo",
                 "torch._inductor", "transformers", "triton", "fastapi", "uvicorn", "plotly",
                 "ipywidgets", "pandas", "scipy", "gguf", "labkit.kernels", "labkit.spec",
                 "labkit.lora", "labkit.quant", "labkit.serve", "labkit.viz", "labkit.bench",
                 "labkit.train", "labkit.parallel")

CHILD = """
import json, sys
import labkit
llm = labkit.LLM('labkit-tiny')
out = llm.generate(['def f(x):'], labkit.SamplingParams(temperature=0, max_tokens=2))
print(json.dumps({"tokens": len(out[0].outputs[0].token_ids),
                  "loaded": [m for m in json.loads(sys.argv[1]) if m in sys.modules]}))
"""


@pytest.mark.skipif(not (models_dir() / "labkit-tiny" / "config.json").is_file(),
                    reason="labkit-tiny is not built (labkit train)")
def test_first_token_imports_nothing_it_does_not_need():
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(MUST_STAY_OUT)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["tokens"] == 2
    assert got["loaded"] == [], f"imported on the generate path: {got['loaded']}"


def test_materialize_gives_what_to_empty_gives():
    ref = tiny_model(0)
    with empty_model():
        a = type(ref)(ref.config)
    with empty_model():
        b = type(ref)(ref.config)
    a, b = materialize(a, "cpu"), b.to_empty(device="cpu")
    sa, sb = a.state_dict(keep_vars=True), b.state_dict(keep_vars=True)
    assert list(sa) == list(sb) == list(ref.state_dict())
    for name in sa:
        assert (sa[name].shape, sa[name].dtype, sa[name].device) == \
            (sb[name].shape, sb[name].dtype, sb[name].device), name
        assert isinstance(sa[name], torch.nn.Parameter) == isinstance(sb[name], torch.nn.Parameter)
    assert all(p.device.type == "cpu" for p in a.parameters())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int8])
def test_pool_zeros_is_a_writable_zero_tensor(dtype):
    shape = (5, 16, 2, 8)
    a, b = pool_zeros(shape, dtype, "cpu"), pool_zeros(shape, dtype, "cpu")
    assert a.shape == shape and a.dtype == dtype and a.is_contiguous()
    assert torch.equal(a, torch.zeros(shape, dtype=dtype))
    a[3, 7] = 1
    assert int(a.sum()) == 2 * 8 and int(b.abs().sum()) == 0  # separate maps
    assert pool_zeros((0, 16, 2, 8), dtype, "cpu").numel() == 0

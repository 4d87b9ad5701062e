"""Fused q|k|v and gate|up (issue 31's first cure): the same logits and greedy tokens, one
matmul per group, and the original weights still there under their Hugging Face names (views of
the fused tensor, so export and in-place updates stay exact)."""

from __future__ import annotations

import copy

import torch

import labkit
from labkit.model.fuse import fuse_projections, is_fused
from labkit.model.generate import generate


def _tiny():
    model, tok = labkit.load_pretrained("labkit-tiny", dtype="float32")
    return model, tok


def test_fused_model_gives_the_same_logits_and_keeps_its_state_dict():
    model, _ = _tiny()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 4096, (2, 17), generator=torch.Generator().manual_seed(0))
    n = len(model.model.layers)
    assert fuse_projections(model) == 2 * n and is_fused(model)
    assert fuse_projections(model) == 0  # idempotent
    with torch.no_grad():
        torch.testing.assert_close(model(ids), ref(ids), atol=1e-5, rtol=1e-5)
    sd, want = model.state_dict(), ref.state_dict()
    assert list(sd) == list(want)  # no fused names: export and loaders see the HF layout
    for k in want:
        torch.testing.assert_close(sd[k], want[k], atol=0, rtol=0)
    a = model.model.layers[0].self_attn
    # the q rows of the fused weight *are* q_proj's weight: one tensor, no copy
    assert a.q_proj.weight.data_ptr() == a.qkv_proj.weight.data_ptr()
    calls = []
    a.q_proj.register_forward_hook(lambda *_: calls.append("q"))
    with torch.no_grad():
        model(ids)
    assert calls == []  # the separate projection is no longer called


def test_an_in_place_update_reaches_the_fused_matmul():
    model, _ = _tiny()
    fuse_projections(model)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        before = model(ids)
        model.model.layers[0].self_attn.v_proj.weight.mul_(2.0)
        model.model.layers[0].mlp.up_proj.weight.mul_(0.5)
        after = model(ids)
    assert not torch.allclose(before, after)


def test_greedy_through_the_engine_equals_the_unfused_reference():
    model, tok = _tiny()
    prompts = [tok.encode(p) for p in ("def fib(n):", "import os\n", "class Stack:")]
    want = [generate(model, p, 16, ignore_eos=True) for p in prompts]
    fuse_projections(model)
    llm = labkit.LLM.from_model(model, tok, block_size=8, max_num_batched_tokens=8)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=labkit.SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs] == want

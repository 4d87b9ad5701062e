"""Mixture-of-experts checkpoints through ``labkit.LLM``: greedy output equals transformers'
``generate`` token for token on every engine path (paged KV, prefix cache, chunked prefill,
preemption, speculative decoding with a dense or an MoE draft)."""

from __future__ import annotations

import pytest
import torch

from labkit import LLM, SamplingParams
from labkit.engine.invariants import assert_no_leaks
from labkit.model.moe import routing
from labkit.model.testing import tiny_model, tiny_moe_checkpoint

pytest.importorskip("transformers")

MAX_NEW = 8
ARCHS = ["mixtral", "qwen3_moe", "qwen2_moe"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_engine")
    return {a: tiny_moe_checkpoint(root / a, a, seed=10 + i) for i, a in enumerate(ARCHS)}


@pytest.fixture(scope="module")
def prompts():
    """Lengths 1..29, two sharing a 12-token prefix (prefix-cache hits at block size 4)."""
    g = torch.Generator().manual_seed(7)
    r = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    shared = r(12)
    return [r(5), shared + r(6), r(1), r(29), shared + r(9), r(13)]


@pytest.fixture(scope="module")
def references(ckpts, prompts):
    """transformers' greedy continuation of every prompt, per architecture (an explicit
    attention mask: token 0 in a prompt is a real token here, not padding)."""
    out = {}
    for arch, (hf, _) in ckpts.items():
        with torch.no_grad():
            out[arch] = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p)),
                                     max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                                     pad_token_id=0)[0, len(p):].tolist()
                         for p in prompts]
    return out


def _generate(path, prompts, **kw):
    llm = LLM(model=str(path), dtype=torch.float32, device="cpu", **kw)
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    assert_no_leaks(llm.llm_engine)
    return [o.outputs[0].token_ids for o in outs], llm.llm_engine


PATHS = {
    "paged": dict(block_size=16),
    "prefix+chunked": dict(block_size=4, enable_prefix_caching=True,
                           enable_chunked_prefill=True, max_num_batched_tokens=8,
                           max_num_seqs=3),
    "preempt": dict(block_size=4, num_blocks=14, max_num_batched_tokens=16),
    "preempt-swap": dict(block_size=4, num_blocks=14, max_num_batched_tokens=16,
                         preemption_mode="swap", num_cpu_blocks=32),
}


@pytest.mark.parametrize("path_name", list(PATHS))
@pytest.mark.parametrize("arch", ARCHS)
def test_engine_greedy_equals_transformers(ckpts, prompts, references, arch, path_name):
    got, eng = _generate(ckpts[arch][1], prompts, **PATHS[path_name])
    assert got == references[arch]
    steps = eng.trace.steps
    if path_name == "prefix+chunked":
        assert eng.stats()["prefix_hit_tokens"] > 0
        assert any(s["chunked"] for st in steps for s in st["scheduled"])
    if path_name.startswith("preempt"):
        mode = "swap" if path_name.endswith("swap") else "recompute"
        assert {p["mode"] for st in steps for p in st["preempted"]} == {mode}


def test_routing_record_covers_the_last_step(ckpts, prompts):
    """After a step, each MoE layer's record holds that step's packed tokens: as many rows as
    the step scheduled, each choosing num_experts_per_tok distinct experts."""
    llm = LLM(model=str(ckpts["qwen2_moe"][1]), dtype=torch.float32, device="cpu", block_size=4)
    eng = llm.llm_engine
    sp = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    for i, p in enumerate(prompts[:3]):
        eng.add_request(str(i), p, sp)
    eng.step()
    n = eng.trace.steps[-1]["num_batched_tokens"]
    rec = routing(llm.model)
    cfg = llm.model.config
    assert sorted(rec) == cfg.moe_layers == [0, 2]
    for r in rec.values():
        assert r.router_logits.shape == (n, cfg.num_experts)
        assert r.topk_ids.shape == (n, cfg.num_experts_per_tok)
        assert all(len(set(row)) == len(row) for row in r.topk_ids.tolist())


@pytest.mark.parametrize("draft_kind", ["dense", "moe"])
def test_speculative_decoding_with_an_moe_target(ckpts, prompts, references, draft_kind):
    """A Mixtral target verifies a dense Llama draft or a Qwen3-MoE draft (same 256-token
    vocabulary): the output is the target's greedy output whatever the draft proposes."""
    if draft_kind == "dense":
        draft = tiny_model(3, vocab_size=256)
    else:
        from labkit.model.loader import load_model

        draft = load_model(ckpts["qwen3_moe"][1])
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    got, eng = _generate(ckpts["mixtral"][1], prompts, block_size=4, speculative_config=spec)
    assert got == references["mixtral"]
    records = [r for st in eng.trace.steps for r in st["spec"]]
    assert records and sum(len(r["proposed"]) for r in records) > 0


def test_trace_records_expert_load_per_layer_per_step(ckpts, prompts):
    """Each step that ran a forward carries expert_load [MoE layer][expert]; the counts equal
    the top-k recomputed by hand (a hook on each MoE layer's input, the router weight, softmax,
    top-k) for that step's forward, and survive the trace's JSON round trip."""
    from labkit.engine.trace import Trace

    llm = LLM(model=str(ckpts["qwen2_moe"][1]), dtype=torch.float32, device="cpu", block_size=4,
              enable_chunked_prefill=True, max_num_batched_tokens=8)
    model, cfg = llm.model, llm.model.config
    by_hand: list[list[list[int]]] = []

    def hook(mlp, args):
        x = args[0].reshape(-1, cfg.hidden_size)
        top = torch.topk(torch.softmax(x @ mlp.gate.weight.T, -1), cfg.num_experts_per_tok)
        row = torch.bincount(top.indices.flatten(), minlength=cfg.num_experts).tolist()
        if mlp.layer_idx == cfg.moe_layers[0]:
            by_hand.append([])
        by_hand[-1].append(row)

    for i in cfg.moe_layers:
        model.model.layers[i].mlp.register_forward_pre_hook(hook)
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate(prompt_token_ids=prompts, sampling_params=sp)
    trace = Trace.from_json(llm.llm_engine.trace.to_json())
    assert trace.meta["moe_layers"] == cfg.moe_layers == [0, 2]
    loads = [st["expert_load"] for st in trace.steps if "expert_load" in st]
    assert loads == by_hand and len(loads) == sum(1 for st in trace.steps if st["scheduled"])
    for st in trace.steps:
        if "expert_load" in st:
            for row in st["expert_load"]:
                assert sum(row) == st["num_batched_tokens"] * cfg.num_experts_per_tok


def test_expert_load_probe_skips_steps_without_a_forward(ckpts):
    from labkit.model.loader import load_model
    from labkit.model.moe import ExpertLoadProbe

    model = load_model(ckpts["mixtral"][1])
    probe = ExpertLoadProbe(model)
    assert probe() is None  # nothing has run
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    first = probe()
    assert [sum(r) for r in first] == [3 * 2, 3 * 2]
    assert probe() is None  # no forward since: an idle step must not repeat the last load


def test_dense_trace_has_no_expert_load():
    llm = LLM(tiny_model(0), block_size=4)
    llm.generate(prompt_token_ids=[[1, 2, 3]],
                 sampling_params=SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    eng = llm.llm_engine
    assert "moe_layers" not in eng.trace.meta and not eng.observer.probes
    assert all("expert_load" not in st for st in eng.trace.steps)


def test_triton_backend_runs_the_fused_moe_kernel(ckpts, prompts, references, monkeypatch):
    """attention_backend="triton": the experts go through kernels/fused_moe.py (counted), the
    greedy output still equals transformers'; the torch backend puts the loop back."""
    import labkit.kernels.fused_moe as fm

    calls = []
    real = fm.fused_moe
    monkeypatch.setattr(fm, "fused_moe", lambda *a, **k: calls.append(1) or real(*a, **k))
    arch = "qwen2_moe"
    got, eng = _generate(ckpts[arch][1], prompts[:3], block_size=16, attention_backend="triton")
    assert got == references[arch][:3]
    assert len(calls) >= len(eng.executor.model.config.moe_layers)
    n = len(calls)
    got, _ = _generate(ckpts[arch][1], prompts[:1], block_size=16)
    assert got == references[arch][:1] and len(calls) == n

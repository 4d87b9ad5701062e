"""The routing widgets on a real tiny MoE engine run (transformers' Qwen2-MoE, saved and loaded).

The heatmap must show exactly the trace's expert_load at every step the slider reaches, and the
token view exactly the top-1 expert recomputed by hand from the router weights."""

import pytest
import torch

from labkit import LLM, SamplingParams
from labkit.model.moe import routing
from labkit.model.testing import tiny_moe_checkpoint
from labkit.viz import ExpertLoadWidget, TokenRoutingWidget
from labkit.viz.moe import expert_load_series, imbalance

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    _, path = tiny_moe_checkpoint(tmp_path_factory.mktemp("moe") / "qwen2_moe", "qwen2_moe")
    llm = LLM(model=str(path), dtype=torch.float32, device="cpu", block_size=4,
              enable_chunked_prefill=True, max_num_batched_tokens=8)
    sp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    llm.generate(prompt_token_ids=[list(range(3, 14)), [7, 8, 9]], sampling_params=sp)
    return llm


def test_heatmap_equals_the_trace_at_every_step(llm):
    trace = llm.llm_engine.trace
    recorded = [(st["step"], st["expert_load"]) for st in trace.steps if "expert_load" in st]
    w = ExpertLoadWidget(llm.llm_engine)
    assert list(w.slider.options) == [s for s, _ in recorded] and len(recorded) > 3
    busiest = max(recorded, key=lambda r: sum(map(sum, r[1])))
    assert w.slider.value == busiest[0]
    for step, load in recorded:  # scrub the whole run
        w.slider.value = step
        hm = w.figure.data[0]
        assert [list(r) for r in hm.z] == load
        assert list(hm.y) == [f"layer {i}" for i in trace.meta["moe_layers"]] == \
            ["layer 0", "layer 2"]
        assert f"step {step}" in w.figure.layout.title.text
        assert f"{max(imbalance(r) for r in load):.2f}" in w.summary.value
        # every row routes num_batched_tokens x top-k slots (top-2 here)
        st = next(s for s in trace.steps if s["step"] == step)
        assert all(sum(r) == 2 * st["num_batched_tokens"] for r in hm.z)


def test_imbalance_by_hand():
    assert imbalance([2, 2, 2, 2]) == 1.0
    assert imbalance([8, 0, 0, 0]) == 4.0
    assert imbalance([3, 1, 0, 0]) == 3.0  # max 3 over mean 1
    assert imbalance([0, 0]) == 1.0


def test_token_view_is_the_top1_expert_by_hand(llm):
    model, cfg = llm.model, llm.model.config
    prompt = [5, 17, 200, 31, 4, 4, 99]
    inputs: dict[int, torch.Tensor] = {}
    hooks = [model.model.layers[i].mlp.register_forward_pre_hook(
        lambda m, a: inputs.__setitem__(m.layer_idx, a[0].reshape(-1, cfg.hidden_size)))
        for i in cfg.moe_layers]
    with torch.no_grad():
        model(torch.tensor([prompt]))
    for h in hooks:
        h.remove()
    w = TokenRoutingWidget(routing(model), prompt)
    hm = w.figure.data[0]
    for row, i in zip(hm.z, cfg.moe_layers):
        gate = model.model.layers[i].mlp.gate.weight
        by_hand = torch.softmax(inputs[i] @ gate.T, -1).argmax(-1).tolist()
        assert list(row) == by_hand
    assert len(hm.x) == len(prompt) and hm.zmax == cfg.num_experts - 0.5
    w.layer.value = cfg.moe_layers[1]
    assert w.tokens.value.count("title='expert ") == len(prompt)
    assert w.tokens.value.startswith(f"<div><b>layer {cfg.moe_layers[1]}</b>")


def test_refusals(llm):
    from labkit.model.testing import tiny_model

    dense = LLM(tiny_model(0), block_size=4)
    dense.generate(prompt_token_ids=[[1, 2, 3]],
                   sampling_params=SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    with pytest.raises(ValueError, match="no MoE layers"):
        expert_load_series(dense.llm_engine)
    with pytest.raises(ValueError, match="no routing recorded"):
        TokenRoutingWidget({}, [1, 2])
    with pytest.raises(ValueError, match="routed 2 tokens, the prompt has 3"):
        with torch.no_grad():
            llm.model(torch.tensor([[1, 2]]))
        TokenRoutingWidget(routing(llm.model), [1, 2, 3])
    with pytest.raises(ValueError, match="recorded no expert load"):
        ExpertLoadWidget(llm.llm_engine, step=10_000)

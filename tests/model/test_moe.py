"""Mixture-of-experts models (Mixtral, Qwen3-MoE, Qwen2-MoE) equal transformers on tiny random
checkpoints written by ``save_pretrained``; the routing record equals a hand recomputation."""

import json

import pytest
import torch
import torch.nn.functional as F

from labkit.model import ConfigError, ModelConfig, generate
from labkit.model.loader import CheckpointError, load_model
from labkit.model.moe import (
    SparseMoeBlock,
    checkpoint_state_dict,
    expert_load,
    fused_experts_loop,
    routing,
    use_fused_experts,
)
from labkit.model.testing import tiny_moe_checkpoint

transformers = pytest.importorskip("transformers")

CASES = {  # name: (architecture key, overrides)
    "mixtral": ("mixtral", {}),
    "mixtral-window8": ("mixtral", dict(sliding_window=8)),
    "qwen3_moe": ("qwen3_moe", {}),
    "qwen3_moe-step2-nonorm-bias": ("qwen3_moe", dict(num_hidden_layers=3,
                                                      decoder_sparse_step=2,
                                                      norm_topk_prob=False,
                                                      attention_bias=True)),
    "qwen2_moe": ("qwen2_moe", {}),
    "qwen2_moe-norm-top4": ("qwen2_moe", dict(norm_topk_prob=True, num_experts_per_tok=4)),
    # windows shorter than the 33-token prompts: Qwen3-MoE slides every layer, Qwen2-MoE the
    # even layers below max_window_layers (layers 0 and 2 here)
    "qwen3_moe-window8": ("qwen3_moe", dict(use_sliding_window=True, sliding_window=8)),
    "qwen2_moe-window8": ("qwen2_moe", dict(use_sliding_window=True, sliding_window=8,
                                            max_window_layers=3)),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {name: tiny_moe_checkpoint(root / name, arch, seed=i, **kw)
            for i, (name, (arch, kw)) in enumerate(CASES.items())}


def _ids(T, B=2, seed=0):
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed + T))


@pytest.mark.parametrize("name", list(CASES))
def test_logits_match_transformers(ckpts, name):
    hf, path = ckpts[name]
    ours = load_model(path)
    for T in (1, 7, 33):
        ids = _ids(T)
        with torch.no_grad():
            torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_in_memory_names_equal_transformers(ckpts, name):
    """Stacked experts under transformers 5's in-memory names; the on-disk per-expert names
    come back from checkpoint_state_dict exactly as save_pretrained wrote them."""
    from safetensors.torch import load_file

    hf, path = ckpts[name]
    ours = load_model(path)
    assert set(ours.state_dict()) == set(hf.state_dict())
    disk = load_file(str(path / "model.safetensors"))
    back = checkpoint_state_dict(ours)
    assert set(back) == set(disk)
    for k, v in disk.items():
        assert torch.equal(back[k], v), k


def test_layer_specs_follow_the_config(ckpts):
    cfg = load_model(ckpts["qwen2_moe"][1]).config  # mlp_only_layers=[1]
    assert [s.mlp for s in cfg.layer_specs()] == ["moe", "dense", "moe"]
    cfg = load_model(ckpts["qwen3_moe-step2-nonorm-bias"][1]).config  # (i + 1) % 2 == 0
    assert [s.mlp for s in cfg.layer_specs()] == ["dense", "moe", "dense"]
    assert cfg.qk_norm and not cfg.norm_topk_prob
    q3 = load_model(ckpts["qwen3_moe-window8"][1]).config
    assert [s.sliding_window for s in q3.layer_specs()] == [8, 8]
    q2 = load_model(ckpts["qwen2_moe-window8"][1]).config
    assert [s.sliding_window for s in q2.layer_specs()] == [8, None, 8]
    mix = load_model(ckpts["mixtral-window8"][1]).config
    assert mix.moe_layers == [0, 1] and mix.norm_topk_prob
    assert [s.sliding_window for s in mix.layer_specs()] == [8, 8]


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_greedy_generation_matches_transformers(ckpts, name):
    hf, path = ckpts[name]
    ours = load_model(path)
    prompt = [5, 17, 42, 8, 3, 200, 77]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                          max_new_tokens=16, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert generate(ours, prompt, 16, ignore_eos=True) == ref


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe-step2-nonorm-bias", "qwen2_moe-norm-top4"])
def test_routing_record_matches_hand_recomputation(ckpts, name):
    """The record of each MoE layer equals the router recomputed by hand from the layer's
    input (captured by a hook) and the router weight: logits = x Wᵀ, top-k of the softmax."""
    _, path = ckpts[name]
    model = load_model(path)
    cfg = model.config
    inputs = {}
    hooks = [layer.mlp.register_forward_pre_hook(
        lambda m, a, i=i: inputs.__setitem__(i, a[0].reshape(-1, a[0].shape[-1])))
        for i, layer in enumerate(model.model.layers)]
    ids = _ids(9, B=2, seed=3)
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    rec = routing(model)
    assert sorted(rec) == cfg.moe_layers
    for i, r in rec.items():
        x, w = inputs[i], model.model.layers[i].mlp.gate.weight
        logits = x @ w.T
        torch.testing.assert_close(r.router_logits, logits, atol=1e-5, rtol=1e-5)
        want = torch.topk(torch.softmax(logits, -1), cfg.num_experts_per_tok, -1).indices
        assert r.topk_ids.shape == (ids.numel(), cfg.num_experts_per_tok)
        assert torch.equal(r.topk_ids, want)
        load = torch.zeros(cfg.num_experts, dtype=torch.long)
        for e in want.flatten().tolist():
            load[e] += 1
        assert expert_load(model)[i] == load.tolist()


def test_fused_experts_loop_equals_dense_mixture():
    """The loop over experts equals the definition: every expert on every token, weighted by
    the routing weight where chosen and zero elsewhere (also with empty experts, one token,
    and all tokens on one expert)."""
    g = torch.Generator().manual_seed(0)
    E, H, inter, k = 5, 12, 7, 2
    w13, w2 = torch.randn(E, 2 * inter, H, generator=g), torch.randn(E, H, inter, generator=g)

    def dense(x, w, ids):
        out = torch.zeros_like(x)
        for e in range(E):
            gate, up = (x @ w13[e].T).chunk(2, -1)
            y = (F.silu(gate) * up) @ w2[e].T
            out += y * (w * (ids == e)).sum(-1, keepdim=True)
        return out

    for T, ids in [(6, None), (1, None), (4, torch.tensor([[3, 1]] * 4))]:
        x = torch.randn(T, H, generator=g)
        if ids is None:
            ids = torch.stack([torch.randperm(E - 1, generator=g)[:k] for _ in range(T)])
        w = torch.rand(T, k, generator=g)
        torch.testing.assert_close(fused_experts_loop(x, w13, w2, w, ids), dense(x, w, ids),
                                   atol=1e-5, rtol=1e-5)


def test_fused_experts_is_the_seam(ckpts):
    """use_fused_experts swaps the one method every MoE layer calls; None restores the loop."""
    _, path = ckpts["qwen2_moe"]
    model = load_model(path)
    ids = _ids(5)
    with torch.no_grad():
        ref = model(ids)
        calls = []

        def spy(*args):
            calls.append(tuple(a.shape for a in args))
            return fused_experts_loop(*args)

        assert use_fused_experts(model, spy) == 2
        torch.testing.assert_close(model(ids), ref, atol=0, rtol=0)
        assert calls == [((10, 64), (8, 64, 64), (8, 64, 32), (10, 2), (10, 2))] * 2
        use_fused_experts(model, lambda *a: torch.zeros_like(a[0]))
        assert not torch.allclose(model(ids), ref)
        use_fused_experts(model, None)
        torch.testing.assert_close(model(ids), ref, atol=0, rtol=0)


def test_routing_mistakes_move_the_logits(ckpts):
    """Negative control for the 1e-4 comparison: dropping (or adding) the renormalisation, or
    the shared expert's gate, changes the logits by far more than the tolerance."""
    hf, path = ckpts["qwen2_moe"]
    ids = _ids(7)
    with torch.no_grad():
        ref = hf(ids).logits
        model = load_model(path)
        for b in model.modules():
            if isinstance(b, SparseMoeBlock):
                b.norm_topk_prob = True
        assert (model(ids) - ref).abs().max() > 1e-2
        model = load_model(path)
        for b in model.modules():
            if isinstance(b, SparseMoeBlock):
                b.shared_expert_gate.weight.zero_()  # sigmoid(0) = 1/2, not the learned gate
        assert (model(ids) - ref).abs().max() > 1e-2


def test_load_pretrained_and_low_precision(ckpts):
    import labkit

    hf, path = ckpts["qwen3_moe"]
    model, tok = labkit.load_pretrained(path)
    assert model.config.architecture == "Qwen3MoeForCausalLM"
    assert tok.encode("t5 t17 t42") == [5, 17, 42]
    low = load_model(path, dtype="bfloat16")
    assert low.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    ids = _ids(8)
    with torch.no_grad():
        assert (low(ids).float() - hf(ids).logits).abs().max() < 0.1


def test_missing_or_misshapen_expert_names_the_tensor(ckpts, tmp_path):
    from safetensors.torch import load_file, save_file

    _, path = ckpts["mixtral"]
    disk = load_file(str(path / "model.safetensors"))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((path / "config.json").read_text())
    gone = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    save_file({k: v for k, v in disk.items() if k != gone}, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match=gone.replace(".", r"\.")):
        load_model(broken)
    bad = dict(disk)
    bad[gone] = bad[gone][:-1]
    save_file(bad, str(broken / "model.safetensors"))
    with pytest.raises(CheckpointError, match="has shape"):
        load_model(broken)


def test_bad_moe_configs_are_named(ckpts):
    d = json.loads((ckpts["qwen3_moe"][1] / "config.json").read_text())
    with pytest.raises(ConfigError, match="num_experts_per_tok"):
        ModelConfig.from_hf_dict({**d, "num_experts_per_tok": 9})
    with pytest.raises(ConfigError, match="mlp_only_layers"):
        ModelConfig.from_hf_dict({**d, "mlp_only_layers": [5]})
    with pytest.raises(ConfigError, match="mixture-of-experts architecture"):
        ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                    num_attention_heads=2, num_experts=4, num_experts_per_tok=2)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe-step2-nonorm-bias", "qwen2_moe"])
def test_config_round_trips_through_config_json(ckpts, name):
    """to_hf_dict writes what transformers reads back as the same model: the HF config built
    from it gives the same logits on the same weights, and from_hf_dict gives the same config."""
    hf, path = ckpts[name]
    cfg = load_model(path).config
    d = cfg.to_hf_dict()
    assert ModelConfig.from_hf_dict(d).layer_specs() == cfg.layer_specs()
    assert ModelConfig.from_hf_dict(d).num_parameters() == cfg.num_parameters()
    hf_cfg = transformers.AutoConfig.for_model(**d)
    again = transformers.AutoModelForCausalLM.from_config(hf_cfg).eval()
    again.load_state_dict(hf.state_dict())
    ids = _ids(6)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, hf(ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen2_moe"])
def test_parameter_counts_match_transformers(ckpts, name):
    hf, path = ckpts[name]
    cfg = load_model(path).config
    assert cfg.num_parameters() == sum(p.numel() for p in hf.parameters())
    E, k = cfg.num_experts, cfg.num_experts_per_tok
    per_expert = 3 * cfg.hidden_size * cfg.expert_intermediate_size
    assert cfg.num_parameters() - cfg.num_parameters(active=True) == \
        len(cfg.moe_layers) * (E - k) * per_expert


@pytest.mark.parametrize("name", ["mixtral", "qwen2_moe"])
def test_train_export_writes_what_transformers_loads(ckpts, tmp_path, name):
    """labkit's save_weights writes the experts per expert, as save_pretrained does:
    transformers and labkit both load the file back to the same logits."""
    from labkit.train.export import save_weights

    hf, path = ckpts[name]
    ours = load_model(path)
    out = save_weights(ours, ours.config, tmp_path / "out", dtype=torch.float32)
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    ids = _ids(6)
    with torch.no_grad():
        torch.testing.assert_close(again(ids).logits, hf(ids).logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(load_model(out)(ids), ours(ids), atol=0, rtol=0)

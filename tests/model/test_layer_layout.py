"""The layer layout: per-layer specs from the config, layers built through the registries, and
per-layer sliding windows equal to transformers (Qwen2) and to a hand-written reference (Llama
with ``layer_types``)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labkit.model import ConfigError, ModelConfig, generate
from labkit.model.config import LayerSpec
from labkit.model.layers import MLP_LAYERS, layer_sliding_windows, make_mlp
from labkit.model.llama import Attention, DecoderLayer
from labkit.model.loader import load_model
from labkit.model.testing import tiny_config, tiny_model

transformers = pytest.importorskip("transformers")

S, F_ = "sliding_attention", "full_attention"
BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-5, rope_theta=1000000.0)
QWEN2 = {  # Qwen2's own switch (layers >= max_window_layers slide), and explicit layer_types
    "qwen2-max-window-layers": dict(use_sliding_window=True, sliding_window=8,
                                    max_window_layers=1),
    "qwen2-layer-types": dict(use_sliding_window=True, sliding_window=6,
                              layer_types=[S, F_, S]),
}


def qwen2_checkpoint(tmp_path, name, seed=0):
    cfg = transformers.Qwen2Config(**BASE, **QWEN2[name])
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: perturb them
        for n, p in model.named_parameters():
            if "norm" in n or "bias" in n:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(tmp_path / name)
    return model, tmp_path / name


@pytest.mark.parametrize("name", list(QWEN2))
def test_qwen2_sliding_layers_match_transformers(tmp_path, name):
    """Which layers slide is transformers' own answer; logits and greedy text equal its, with
    prompts longer than the window."""
    hf, path = qwen2_checkpoint(tmp_path, name)
    ours = load_model(path)
    want = [hf.config.sliding_window if t == S else None for t in hf.config.layer_types]
    assert layer_sliding_windows(ours.config) == want and None in want and any(want)
    assert [type(layer.self_attn) for layer in ours.model.layers] == [Attention] * 3
    for T in (1, 7, 33):
        ids = torch.randint(0, 97, (2, T), generator=torch.Generator().manual_seed(T))
        with torch.no_grad():
            torch.testing.assert_close(ours(ids), hf(ids).logits, atol=1e-4, rtol=1e-4)
    for layer in ours.model.layers:  # the windows matter: without them the logits differ
        layer.self_attn.sliding_window = None
    with torch.no_grad():
        assert not torch.allclose(ours(ids), hf(ids).logits, atol=1e-3)
    ours = load_model(path)
    prompt = torch.randint(0, 97, (13,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert generate(ours, prompt, 16, ignore_eos=True) == ref


@pytest.mark.parametrize("kw", [
    dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
    dict(use_sliding_window=True, sliding_window=8, max_window_layers=0),
    dict(use_sliding_window=True, sliding_window=8, max_window_layers=3),  # none slide
    dict(use_sliding_window=False, sliding_window=8, max_window_layers=1),  # switch off
    dict(use_sliding_window=True, sliding_window=4, layer_types=[F_, S, F_]),
    dict(use_sliding_window=False, sliding_window=4, layer_types=[F_, S, F_]),
])
def test_qwen2_config_semantics_equal_transformers(kw):
    """From the same config.json dict, labkit's per-layer windows are transformers' (its
    Qwen2Config fills layer_types; its attention uses the window only on sliding layers)."""
    hf = transformers.Qwen2Config(**BASE, **kw)
    d = {**hf.to_dict(), "architectures": ["Qwen2ForCausalLM"]}
    for key in ("layer_types", "sliding_window"):  # what a hand-written config.json may omit
        if key not in kw:
            d.pop(key, None)
    d["sliding_window"] = kw["sliding_window"]
    want = [hf.sliding_window if t == S else None for t in hf.layer_types]
    cfg = ModelConfig.from_hf_dict(d)
    assert layer_sliding_windows(cfg) == want
    back = ModelConfig.from_hf_dict(cfg.to_hf_dict())  # a saved config reads back the same
    assert back.layer_specs() == cfg.layer_specs()
    hf2 = transformers.Qwen2Config(**cfg.to_hf_dict())  # and transformers reads ours the same
    assert [hf2.sliding_window if t == S else None for t in hf2.layer_types] == want


def test_mistral_window_means_every_layer_and_llama_needs_layer_types():
    d = dict(BASE, architectures=["MistralForCausalLM"], sliding_window=8)
    assert layer_sliding_windows(ModelConfig.from_hf_dict(d)) == [8, 8, 8]
    d["architectures"] = ["LlamaForCausalLM"]  # transformers' Llama has no window
    assert layer_sliding_windows(ModelConfig.from_hf_dict(d)) == [None] * 3
    d["layer_types"] = [S, F_, S]  # labkit's own Llama configs may name the sliding layers
    cfg = ModelConfig.from_hf_dict(d)
    assert layer_sliding_windows(cfg) == [8, None, 8]
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()).layer_specs() == cfg.layer_specs()
    spec = cfg.layer_spec(0)
    assert (spec.attention, spec.sliding_window, spec.mlp) == ("sliding", 8, "dense")
    assert cfg.layer_spec(1).attention == "full" and cfg.uses_sliding_window


@pytest.mark.parametrize("kw,match", [
    (dict(layer_types=[S, F_]), "3 layers"),
    (dict(layer_types=[S, "chunked_attention", F_]), "chunked_attention"),
    (dict(layer_types=[S, F_, F_], sliding_window=None), "sliding_window"),
    (dict(sliding_window=0), "sliding_window"),
])
def test_bad_layer_types_name_the_field(kw, match):
    with pytest.raises(ConfigError, match=match):
        tiny_config(**{"num_hidden_layers": 3, "sliding_window": 8, **kw})


def _reference_logits(model, ids, windows):
    """Hand-written forward: the model's weights, explicit per-layer masks, softmax by hand."""
    c, (T,) = model.config, ids.shape
    x = model.model.embed_tokens(ids)
    pos = torch.arange(T)
    inv = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim)
    ang = torch.cat([pos[:, None] * inv] * 2, dim=-1)

    def rope(t):  # t [T, H, D]
        h = t.shape[-1] // 2
        rot = torch.cat([-t[..., h:], t[..., :h]], dim=-1)
        return t * ang.cos()[:, None] + rot * ang.sin()[:, None]

    def norm(t, w):
        return w * t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + c.rms_norm_eps)

    g = c.num_attention_heads // c.num_key_value_heads
    for layer, w in zip(model.model.layers, windows):
        a, h = layer.self_attn, norm(x, layer.input_layernorm.weight)
        q = rope(a.q_proj(h).view(T, -1, c.head_dim))
        k = rope(a.k_proj(h).view(T, -1, c.head_dim)).repeat_interleave(g, 1)
        v = a.v_proj(h).view(T, -1, c.head_dim).repeat_interleave(g, 1)
        see = pos[None, :] <= pos[:, None]
        if w is not None:
            see &= pos[None, :] > pos[:, None] - w
        s = torch.einsum("qhd,khd->hqk", q, k) / c.head_dim ** 0.5
        p = s.masked_fill(~see, float("-inf")).softmax(-1)
        x = x + a.o_proj(torch.einsum("hqk,khd->qhd", p, v).reshape(T, -1))
        m, h = layer.mlp, norm(x, layer.post_attention_layernorm.weight)
        x = x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))
    return model.lm_head(norm(x, model.model.norm.weight))


def test_llama_alternating_layer_types_match_hand_written_reference():
    types = [S, F_, S, F_]
    model = tiny_model(3, num_hidden_layers=4, layer_types=types, sliding_window=5)
    assert [la.self_attn.sliding_window for la in model.model.layers] == [5, None, 5, None]
    ids = torch.randint(0, 128, (23,), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = model(ids[None])[0]
        torch.testing.assert_close(got, _reference_logits(model, ids, [5, None, 5, None]),
                                   atol=1e-5, rtol=1e-5)
        wrong = _reference_logits(model, ids, [5] * 4)  # windows on every layer differ
        assert not torch.allclose(got, wrong, atol=1e-3)


def test_a_new_mlp_kind_plugs_in_by_registering(monkeypatch):
    """The seam the MoE sparse MLP uses (labkit.model.moe registers "moe"): the config's spec
    names the kind, a registry entry builds it; no branch in the model or the engine. Unknown
    kinds name what is registered."""
    monkeypatch.setattr(ModelConfig, "layer_spec", lambda self, i: LayerSpec(mlp="toy"))
    cfg = tiny_config()
    with pytest.raises(ConfigError,
                       match="mlp 'toy'; labkit builds deepseek_moe, dense, gpt_oss_moe, moe"):
        make_mlp(cfg, 0)

    class Sparse(nn.Module):
        def __init__(self, config, layer_idx):
            super().__init__()
            self.layer_idx = layer_idx

    monkeypatch.setitem(MLP_LAYERS, "toy", Sparse)
    layer = DecoderLayer(cfg, 1)
    assert isinstance(layer.mlp, Sparse) and layer.mlp.layer_idx == 1
    assert isinstance(layer.self_attn, Attention)


def test_fused_qkv_transform_needs_only_the_seam():
    """What issue 31's fused-projection transform will do, in miniature: one matmul for q|k|v
    and one for gate|up, installed on the instances after loading; logits unchanged."""
    model = tiny_model(1, attention_bias=True)
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        before = model(ids)
        for layer in model.model.layers:
            a, m = layer.self_attn, layer.mlp
            w = torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
            b = torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias])
            sizes = [a.q_proj.out_features, a.k_proj.out_features, a.v_proj.out_features]
            a.project_qkv = lambda x, w=w, b=b, n=sizes: F.linear(x, w, b).split(n, dim=-1)
            gu = torch.cat([m.gate_proj.weight, m.up_proj.weight])
            m.gate_up = lambda x, gu=gu: F.linear(x, gu).chunk(2, dim=-1)
        torch.testing.assert_close(model(ids), before, atol=1e-6, rtol=1e-6)


def test_qwen2_sliding_checkpoint_through_the_engine_equals_transformers(tmp_path):
    """labkit.LLM on the loaded folder (paged KV, prefix cache, 8-token chunked prefill, block 4)
    against transformers' own greedy generate, prompts past the window of 8. (The folder has no
    tokenizer, so the model is loaded and handed over.)"""
    from labkit import LLM, SamplingParams

    hf, path = qwen2_checkpoint(tmp_path, "qwen2-max-window-layers", seed=2)
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 97, (12,), generator=g).tolist()
    prompts = [shared + [4, 5], shared + [6], torch.randint(0, 97, (19,), generator=g).tolist()]
    llm = LLM.from_model(load_model(path), block_size=4, max_num_batched_tokens=8)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False,
                              eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
        assert o.outputs[0].token_ids == ref
    assert llm.llm_engine.stats()["prefix_hit_tokens"] > 0

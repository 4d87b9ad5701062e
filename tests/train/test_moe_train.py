"""MoE training: the auxiliary losses against transformers and by hand, gradients reach the
routers, a tiny MoE trains through `train`, and the shipped labkit-tiny-moe loads and matches
transformers and the engine."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from labkit.model.config import ModelConfig
from labkit.model.llama import LlamaForCausalLM
from labkit.model.moe import RoutingRecord, moe_blocks
from labkit.train.moe_loss import load_balancing_loss, moe_aux_losses, router_z_loss
from labkit.train.presets import get_preset

MOE_DIR = Path(__file__).resolve().parents[2] / "datasets" / "models" / "labkit-tiny-moe"


def _tiny_moe(**kw) -> ModelConfig:
    base = dict(vocab_size=64, hidden_size=32, intermediate_size=24, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                max_position_embeddings=64, tie_word_embeddings=True, bos_token_id=0,
                eos_token_id=0, architecture="MixtralForCausalLM", num_experts=4,
                num_experts_per_tok=2, norm_topk_prob=True)
    return ModelConfig(**{**base, **kw})


def test_balance_loss_equals_transformers_over_k():
    """transformers' Mixtral loss divides the slot counts by T (not T*k): ours x k equals it."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 8, generator=g) * 2
    ids = torch.topk(torch.softmax(logits, -1), 2).indices
    theirs = load_balancing_loss_func((logits,), num_experts=8, top_k=2)
    assert float(load_balancing_loss(logits, ids)) * 2 == pytest.approx(float(theirs), rel=1e-5)


def test_balance_and_z_loss_by_hand():
    # uniform router, perfectly spread choices: E * sum_e (1/E)(1/E) = 1
    logits = torch.zeros(4, 4)
    ids = torch.tensor([[0, 1], [2, 3], [0, 1], [2, 3]])
    assert float(load_balancing_loss(logits, ids)) == pytest.approx(1.0)
    # every token on experts 0 and 1, and the router sure of it: f = (1/2, 1/2, 0, 0)
    sure = torch.tensor([[9.0, 9.0, -9.0, -9.0]] * 4)
    p = torch.softmax(sure[0], -1)
    by_hand = 4 * (0.5 * p[0] + 0.5 * p[1])
    assert float(load_balancing_loss(sure, torch.tensor([[0, 1]] * 4))) == \
        pytest.approx(float(by_hand), rel=1e-6)
    assert float(by_hand) > 1.9  # collapse costs ~E/k
    z = torch.tensor([[1.0, 2.0, 3.0], [0.0, 0.0, 0.0]])
    lse = [math.log(math.exp(1) + math.exp(2) + math.exp(3)), math.log(3)]
    assert float(router_z_loss(z)) == pytest.approx((lse[0] ** 2 + lse[1] ** 2) / 2, rel=1e-6)


def test_aux_gradients_reach_every_router():
    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_moe()).train()
    model(torch.randint(0, 64, (2, 9)))
    aux = moe_aux_losses(model)
    (aux["balance"] + aux["z"]).backward()
    blocks = moe_blocks(model)
    for b in blocks:
        assert b.gate.weight.grad is not None and b.gate.weight.grad.abs().sum() > 0
    # the last layer's experts feed no router: the aux losses do not reach them
    assert blocks[-1].experts.gate_up_proj.grad is None
    dense = LlamaForCausalLM(_tiny_moe(architecture="LlamaForCausalLM", num_experts=0,
                                       num_experts_per_tok=0, norm_topk_prob=False))
    dense(torch.randint(0, 64, (1, 5)))
    assert moe_aux_losses(dense) == {}


def test_detached_routing_record_is_refused():
    model = LlamaForCausalLM(_tiny_moe()).train()
    model(torch.randint(0, 64, (1, 6)))
    b = moe_blocks(model)[0]
    b.last_routing = RoutingRecord(b.last_routing.router_logits.detach(),
                                   b.last_routing.topk_ids)
    with pytest.raises(RuntimeError, match="detached"):
        moe_aux_losses(model)


def test_tiny_moe_trains_and_logs_aux_losses(tmp_path):
    from labkit.train.trainer import TrainConfig, train

    g = torch.Generator().manual_seed(0)
    stream = torch.randint(1, 16, (4000,), generator=g).repeat(4)  # learnable: it repeats
    cfg = TrainConfig(seq_len=32, batch_size=8, max_steps=30, lr=1e-2, warmup_steps=3,
                      eval_every=30, eval_max_tokens=512, log_every=10, checkpoint_every=100,
                      aux_loss_coef=0.01, z_loss_coef=0.001)
    _, log = train(_tiny_moe(), cfg, stream, stream[:600], tmp_path / "ck.pt")
    assert log["eval"][-1]["heldout_loss"] < log["eval"][0]["heldout_loss"] - 0.5
    for entry in log["train"]:
        assert 0.9 < entry["balance_loss"] < 2.0 and entry["z_loss"] > 0


def test_preset_is_a_mixtral_with_a_same_active_dense_twin():
    moe, dense = get_preset("labkit-tiny-moe"), get_preset("labkit-tiny-moe-dense")
    assert moe.model.architecture == "MixtralForCausalLM" and moe.model.num_experts == 8
    assert moe.model.num_experts_per_tok == 2 and moe.aux_loss_coef > 0 and moe.z_loss_coef > 0
    routers = moe.model.num_hidden_layers * moe.model.num_experts * moe.model.hidden_size
    assert moe.model.num_parameters(active=True) == dense.model.num_parameters() + routers


# ---- the shipped folder ------------------------------------------------------------------
@pytest.fixture(scope="module")
def shipped():
    if not (MOE_DIR / "model.safetensors").is_file():
        pytest.skip("labkit-tiny-moe is not in datasets/models")
    return MOE_DIR


def test_shipped_layout(shipped):
    cfg = json.loads((shipped / "config.json").read_text())
    assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["model_type"] == "mixtral"
    with safe_open(str(shipped / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.block_sparse_moe.experts.7.w3.weight" in keys
    assert "model.layers.3.block_sparse_moe.gate.weight" in keys
    assert not any("gate_up_proj" in k for k in keys)
    assert (shipped / "model.safetensors").stat().st_size < 8_000_000
    tiny = shipped.parent / "labkit-tiny" / "tokenizer.json"
    assert (shipped / "tokenizer.json").read_bytes() == tiny.read_bytes()
    log = json.loads((shipped / "train_log.json").read_text())
    card = (shipped / "README.md").read_text()
    assert f"{log['shipped']['heldout_loss_fp16_weights']:.4f}" in card
    assert f"{log['active_parameters']:,}" in card and "max / mean" in card


def test_shipped_logits_equal_transformers(shipped):
    transformers = pytest.importorskip("transformers")
    from labkit.model.loader import load_pretrained

    model, tok = load_pretrained("labkit-tiny-moe", dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(shipped),
                                                           dtype=torch.float32).eval()
    ids = torch.tensor([tok.encode("class Stack:\n    def push(self, item):\n")])
    with torch.no_grad():
        ours, theirs = model(ids), hf(ids).logits
    assert torch.allclose(ours, theirs, rtol=1e-4, atol=1e-4)


def test_shipped_engine_greedy_equals_reference(shipped):
    import labkit
    from labkit.model.generate import generate

    llm = labkit.LLM(model="labkit-tiny-moe", dtype=torch.float32, device="cpu", block_size=8)
    prompts = ["def fibonacci(n):", "import os\n"]
    ids = [llm.tokenizer.encode(p) for p in prompts]
    sp = labkit.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=ids, sampling_params=sp)
    for i, o in zip(ids, outs):
        assert list(o.outputs[0].token_ids) == generate(llm.model, i, 12, ignore_eos=True)

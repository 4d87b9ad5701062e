"""Pruning: the smaller model equals the original with the pruned units zeroed; masks are what
they claim; pruned models save, load (labkit and transformers) and run in the engine."""

import pytest
import torch

from labkit.compress.prune import (
    apply_masks,
    decoder_weights,
    importance,
    is_2_4,
    magnitude_mask,
    mask_2_4,
    prune_masked,
    prune_structured,
)


def _zeroed_reference(model, pruned_heads, pruned_channels):
    """The original model with the removed heads' o_proj columns and the removed channels'
    down_proj columns zeroed: computes exactly what the pruned model computes."""
    import copy

    ref = copy.deepcopy(model)
    d = model.config.head_dim
    with torch.no_grad():
        for i, layer in enumerate(ref.model.layers):
            for h in pruned_heads[i]:
                layer.self_attn.o_proj.weight[:, h * d:(h + 1) * d] = 0
            layer.mlp.down_proj.weight[:, pruned_channels[i]] = 0
    return ref


@pytest.mark.parametrize("method", ["magnitude", "activation", "gradient"])
def test_structured_pruning_equals_zeroing_the_units(make_model, tokens, method):
    m = make_model()
    scores = importance(m, tokens, method)
    assert scores["heads"].shape == (2, 4) and scores["channels"].shape == (2, 64)
    small = prune_structured(m, scores, head_fraction=0.5, ffn_fraction=0.25)
    cfg = small.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size) == (2, 2, 48)
    heads, chans = [], []
    for i in range(2):  # one head of each 2-head KV group, the less important
        s = scores["heads"][i]
        heads.append([g * 2 + int(s[g * 2:g * 2 + 2].argmin()) for g in range(2)])
        chans.append(scores["channels"][i].argsort()[:16].tolist())
    with torch.no_grad():
        torch.testing.assert_close(small(tokens), _zeroed_reference(m, heads, chans)(tokens),
                                   rtol=1e-5, atol=1e-5)


def test_importance_ranks_a_dead_head_and_channel_last(make_model, tokens):
    m = make_model()
    d = m.config.head_dim
    with torch.no_grad():
        m.model.layers[0].self_attn.o_proj.weight[:, 1 * d:2 * d] = 0
        m.model.layers[0].mlp.down_proj.weight[:, 5] = 0
    for method in ("magnitude", "activation", "gradient"):
        s = importance(m, tokens, method)
        assert int(s["heads"][0].argmin()) == 1 and float(s["heads"][0, 1]) == 0
        assert int(s["channels"][0].argmin()) == 5


def test_zero_fraction_is_the_same_model(make_model, tokens):
    m = make_model()
    small = prune_structured(m, importance(m, method="magnitude"), 0.0, 0.0)
    with torch.no_grad():
        assert torch.equal(small(tokens), m(tokens))
    with pytest.raises(ValueError, match="calibration"):
        importance(m, None, "activation")


def test_2_4_mask_keeps_the_two_largest_of_every_four():
    w = torch.randn(8, 16, generator=torch.Generator().manual_seed(0))
    keep = mask_2_4(w)
    assert is_2_4(w * keep) and keep.sum() == w.numel() // 2
    for row, krow in zip(w.abs().view(-1, 4), keep.view(-1, 4)):
        assert set(row.argsort()[2:].tolist()) == set(krow.nonzero().flatten().tolist())
    with pytest.raises(ValueError, match="divisible by 4"):
        mask_2_4(torch.randn(2, 6))


def test_magnitude_mask_removes_the_smallest():
    w = torch.arange(1.0, 101.0).view(10, 10) * torch.tensor([1.0, -1.0]).repeat(50).view(10, 10)
    keep = magnitude_mask(w, 0.3)
    assert keep.sum() == 70 and bool((w.abs()[keep] > 30).all())


def test_healing_keeps_the_masks(make_model):
    from labkit.compress.distill import DistillConfig, distill
    from labkit.train.trainer import TrainConfig

    teacher = make_model()
    student, masks = prune_masked(teacher, "2:4")
    data = torch.randint(0, 96, (2000,), generator=torch.Generator().manual_seed(0))
    cfg = TrainConfig(seq_len=16, batch_size=4, max_steps=3, lr=1e-2, warmup_steps=1,
                      eval_every=10, weight_decay=0.0)
    distill(student, teacher, cfg, DistillConfig(), data, data[:200], progress=False,
            after_step=lambda m: apply_masks(m, masks))
    for name, w in decoder_weights(student).items():
        assert is_2_4(w) and not w[~masks[name]].any()


def test_pruned_model_saves_loads_and_runs_in_the_engine(make_model, tokens, tmp_path):
    from labkit import LLM, SamplingParams
    from labkit.model.generate import generate
    from labkit.model.loader import load_pretrained
    from labkit.train.export import export_hf

    m = make_model()
    small = prune_structured(m, importance(m, tokens, "activation"), 0.5, 0.25)
    tok_dir = tmp_path / "tok"
    tok_dir.mkdir()
    from labkit.train.tokenizer import save_tokenizer, train_tokenizer

    save_tokenizer(train_tokenizer(["def f(x):\n    return x\n"] * 20, vocab_size=300), tok_dir,
                   128)
    export_hf(small, small.config, tok_dir, tmp_path / "pruned", dtype=torch.float32)
    loaded, _ = load_pretrained(tmp_path / "pruned")
    assert loaded.config.num_attention_heads == 2 and loaded.config.intermediate_size == 48
    with torch.no_grad():
        assert torch.equal(loaded(tokens), small(tokens))
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "pruned"),
                                                           dtype=torch.float32).eval()
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, small(tokens), rtol=1e-4, atol=1e-4)
    prompt = tokens[0, :8].tolist()
    out = LLM(loaded).generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0.0, max_tokens=10, ignore_eos=True, detokenize=False))
    assert out[0].outputs[0].token_ids == generate(loaded, prompt, 10, ignore_eos=True)


def test_pruned_parameter_count_by_hand(make_model, tokens):
    """hidden 32, 4 heads of 8 (2 KV heads), FFN 64, 2 layers, vocab 96 (tied embeddings)."""
    m = make_model()
    per_layer = 32 * 32 + 2 * 16 * 32 + 32 * 32 + 3 * 32 * 64 + 2 * 32  # q, k+v, o, MLP, norms
    assert sum(p.numel() for p in m.parameters()) == 96 * 32 + 2 * per_layer + 32 == 21664
    small = prune_structured(m, importance(m, tokens, "activation"), 0.5, 0.25)
    removed = 2 * (2 * (2 * 8 * 32) + 3 * 16 * 32)  # per layer: 2 heads in q and o, 16 channels
    assert sum(p.numel() for p in small.parameters()) == 21664 - removed == 16544
    layer = small.model.layers[0]
    assert tuple(layer.self_attn.q_proj.weight.shape) == (16, 32)
    assert tuple(layer.self_attn.o_proj.weight.shape) == (32, 16)
    assert tuple(layer.mlp.down_proj.weight.shape) == (32, 48)


def _kl(dense, model, x):
    import torch.nn.functional as F

    with torch.no_grad():
        p, q = F.log_softmax(dense(x), -1), F.log_softmax(model(x), -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def test_recovery_beats_pruning_alone(make_model):
    """On held-out tokens (not the calibration or healing tokens): the least-squares refit
    lowers the KL from the dense model, and healing by distillation lowers it further, on every
    one of 3 seeds."""
    from labkit.compress.distill import DistillConfig, distill
    from labkit.compress.prune import reconstruct
    from labkit.train.trainer import TrainConfig

    for seed in range(3):
        g = torch.Generator().manual_seed(100 + seed)
        calib, held = (torch.randint(0, 96, (16, 32), generator=g) for _ in range(2))
        dense = make_model(seed)
        pruned = prune_structured(dense, importance(dense, calib, "activation"), 0.5, 0.25)
        kl_pruned = _kl(dense, pruned, held)
        reconstruct(pruned, dense, calib)
        kl_refit = _kl(dense, pruned, held)
        data = torch.randint(0, 96, (4000,), generator=g)
        cfg = TrainConfig(seq_len=32, batch_size=8, max_steps=60, lr=1e-3, warmup_steps=2,
                          eval_every=10**6, weight_decay=0.0, seed=seed)
        distill(pruned, dense, cfg, DistillConfig(), data, data[:256], progress=False)
        kl_healed = _kl(dense, pruned, held)
        assert kl_healed < kl_refit < kl_pruned, (seed, kl_pruned, kl_refit, kl_healed)


def test_reconstruct_refuses_too_little_calibration(make_model, tokens):
    from labkit.compress.prune import reconstruct

    m = make_model()
    small = prune_structured(m, importance(m, tokens, "magnitude"), 0.5, 0.25)
    with pytest.raises(ValueError, match="calibration tokens"):
        reconstruct(small, m, tokens[:1, :20])

"""Distillation: the loss against torch's own KL, the T² factor, the loop, the helpers."""

import pytest
import torch
import torch.nn.functional as F

from labkit.compress.distill import (
    DistillConfig,
    agreement,
    batched_greedy,
    distill,
    distill_loss,
    drop_layers,
    kd_loss,
    probe_agreement,
)
from labkit.model.generate import generate
from labkit.train.trainer import TrainConfig


def _logits(seed, shape=(2, 5, 11)):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * 3


@pytest.mark.parametrize("T", [1.0, 2.0, 4.0])
def test_kd_loss_equals_torch_kl_div_times_t_squared(T):
    s, t = _logits(0), _logits(1)
    ls, lt = F.log_softmax(s / T, -1).flatten(0, 1), F.log_softmax(t / T, -1).flatten(0, 1)
    fwd = F.kl_div(ls, lt, log_target=True, reduction="batchmean") * T * T  # KL(p_t || q_s)
    rev = F.kl_div(lt, ls, log_target=True, reduction="batchmean") * T * T  # KL(q_s || p_t)
    assert kd_loss(s, t, T, "forward") == pytest.approx(float(fwd), rel=1e-5)
    assert kd_loss(s, t, T, "reverse") == pytest.approx(float(rev), rel=1e-5)
    assert float(fwd) != pytest.approx(float(rev), rel=1e-2)  # the directions really differ


def test_t_squared_keeps_the_gradient_scale():
    """Without T² the soft-target gradient shrinks like 1/T²; with it, it stays O(1) (Hinton
    et al. 2015): d loss / d logits at T = 8 vs T = 1 differ by far less than 64x."""
    t = _logits(1)
    grads = []
    for T in (1.0, 8.0):
        s = _logits(0).requires_grad_()
        kd_loss(s, t, T).backward()
        grads.append(float(s.grad.norm()))
    assert 0.1 < grads[1] / grads[0] < 10


def test_identical_logits_have_zero_loss_and_hard_weight_mixes_ce():
    s, y = _logits(0), torch.randint(0, 11, (2, 5))
    assert float(kd_loss(s, s.clone(), 3.0)) == pytest.approx(0, abs=1e-6)
    ce = F.cross_entropy(s.flatten(0, 1), y.flatten())
    assert float(distill_loss(s, s, y, DistillConfig(hard_weight=1.0))) == pytest.approx(
        float(ce), rel=1e-6)
    mix = distill_loss(s, _logits(1), y, DistillConfig(temperature=2.0, hard_weight=0.25))
    assert float(mix) == pytest.approx(0.75 * float(kd_loss(s, _logits(1), 2.0)) +
                                       0.25 * float(ce), rel=1e-5)


def test_bad_inputs_are_named():
    with pytest.raises(ValueError, match="same tokenizer"):
        kd_loss(_logits(0), _logits(1, (2, 5, 12)))
    with pytest.raises(ValueError, match="direction"):
        DistillConfig(direction="sideways")
    with pytest.raises(ValueError, match="temperature"):
        DistillConfig(temperature=0)


def test_drop_layers_keeps_the_chosen_layers(make_model, tokens):
    m = make_model()
    with torch.no_grad():
        assert torch.equal(drop_layers(m, [0, 1])(tokens), m(tokens))
        small = drop_layers(m, [1])
        assert small.config.num_hidden_layers == 1
        assert torch.equal(small.model.layers[0].mlp.up_proj.weight,
                           m.model.layers[1].mlp.up_proj.weight)
    with pytest.raises(ValueError, match="distinct layer indices"):
        drop_layers(m, [0, 0])


def test_batched_greedy_equals_reference_generate(make_model, tokens):
    m = make_model()
    out = batched_greedy(m, tokens[:, :6], 7)
    for row, p in zip(out, tokens[:, :6]):
        assert row[6:].tolist() == generate(m, p.tolist(), 7, ignore_eos=True)


def test_distill_moves_the_student_towards_the_teacher(make_model, tokens):
    teacher, student = make_model(0), make_model(1, num_hidden_layers=1)
    data = torch.randint(0, 96, (4000,), generator=torch.Generator().manual_seed(0))
    probe = [(batched_greedy(teacher, tokens[i:i + 1, :4 + i], 12), 4 + i) for i in range(3)]
    before = probe_agreement(student, teacher, probe)
    cfg = TrainConfig(seq_len=16, batch_size=8, max_steps=40, lr=1e-2, warmup_steps=2,
                      eval_every=20, weight_decay=0.0)
    student, log = distill(student, teacher, cfg, DistillConfig(temperature=2.0), data,
                           data[:600], probe=probe, progress=False)
    after = probe_agreement(student, teacher, probe)
    assert after["kl"] < 0.7 * before["kl"]
    assert [e["step"] for e in log["eval"]] == [0, 20, 40]
    assert log["eval"][-1]["kl"] == pytest.approx(after["kl"], rel=1e-4)


def test_agreement_of_a_model_with_itself_is_one(make_model, tokens):
    m = make_model()
    a = agreement(m, m, tokens, 5)
    assert a["top1_agreement"] == 1.0 and a["kl"] == pytest.approx(0, abs=1e-6)
    other = agreement(make_model(1), m, tokens, 5)
    assert other["top1_agreement"] < 0.5 and other["kl"] > 0.1

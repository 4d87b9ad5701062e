"""The compression checkers pass the reference and fail the classic mistakes (negative
controls), each with the hint that names it."""

import pytest
import torch
import torch.nn.functional as F

from labkit.exercises import compression
from labkit.exercises import compression_solutions as S


@pytest.fixture(autouse=True)
def _progress(tmp_path, monkeypatch):
    monkeypatch.setenv("LABKIT_PROGRESS", str(tmp_path / "p.json"))
    monkeypatch.delenv("LABKIT_STRICT_CHECKS", raising=False)
    monkeypatch.delenv("LABKIT_INJECT_SOLUTIONS", raising=False)


def no_t_squared(s, t, T):
    return S.distillation_loss(s, t, T) / T**2


def reverse_kl(s, t, T):
    return S.distillation_loss(t, s, T)


def detached(s, t, T):  # right value, no gradient: training does not move
    return S.distillation_loss(s, t, T).detach().requires_grad_()


def keep_smallest(w):
    return ~S.mask_2_4(w)


def keep_largest_signed(w):
    g = w.reshape(w.shape[0], -1, 4)
    keep = torch.zeros_like(g, dtype=torch.bool)
    keep.scatter_(-1, g.topk(2, dim=-1).indices, True)
    return keep.reshape(w.shape)


def keep_top_half_of_row(w):
    k = w.shape[1] // 2
    m = torch.zeros_like(w, dtype=torch.bool)
    m.scatter_(1, w.abs().topk(k, dim=1).indices, True)
    return m


def test_reference_solutions_pass():
    assert compression.check_distillation_loss(S.distillation_loss)
    assert compression.check_mask_2_4(S.mask_2_4)


@pytest.mark.parametrize("fn,hint", [(no_t_squared, "T² factor is missing"),
                                     (reverse_kl, "reverse KL"),
                                     (detached, "gradient flow")])
def test_wrong_losses_fail(fn, hint, capsys):
    assert not compression.check_distillation_loss(fn)
    assert hint in capsys.readouterr().out


@pytest.mark.parametrize("fn,hint", [(keep_smallest, "kept the smallest"),
                                     (keep_largest_signed, "rank by |w|"),
                                     (keep_top_half_of_row, "exactly 2")])
def test_wrong_masks_fail(fn, hint, capsys):
    assert not compression.check_mask_2_4(fn)
    assert hint in capsys.readouterr().out


def test_solution_equals_torch_kl_div():
    s, t = torch.randn(6, 10), torch.randn(6, 10)
    ref = F.kl_div(F.log_softmax(s / 3, -1), F.log_softmax(t / 3, -1), log_target=True,
                   reduction="batchmean") * 9
    assert float(S.distillation_loss(s, t, 3.0)) == pytest.approx(float(ref), rel=1e-5)

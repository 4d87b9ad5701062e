"""GPTQ against a naive Optimal-Brain-Surgeon reference, and its reason to exist: lower output
error than round-to-nearest on correlated inputs."""

import pytest
import torch

from labkit.quant import CalibrationError, gptq_quantize, gptq_quantize_model, quantize_rtn
from labkit.quant.gptq import HessianAccumulator
from labkit.quant.rtn import group_params, quantize_codes


def _data(K=128, N=32, n=1024, seed=0):
    g = torch.Generator().manual_seed(seed)
    A = torch.randn(K, K, generator=g) / K**0.5
    X = torch.randn(n, K, generator=g) @ A + 0.1 * torch.randn(n, K, generator=g)
    X[:, 3] *= 20  # one loud input channel
    W = torch.randn(N, K, generator=g) * 0.05
    return X.double(), W


def _naive_obs(W, H, gs, damp):
    """Column by column with an explicit inverse, shrinking it by Schur complements."""
    W = W.double().clone()
    K = W.shape[1]
    H = H + damp * torch.diag(H).mean() * torch.eye(K, dtype=H.dtype)
    Hinv = torch.linalg.inv(H)
    codes = torch.zeros_like(W)
    for i in range(K):
        if i % gs == 0:
            s, z = (t.double() for t in group_params(W[:, i:i + gs].float(), 4))
        q = quantize_codes(W[:, i:i + 1], s, z, 4)[:, 0]
        codes[:, i] = q
        err = (W[:, i] - (q - z) * s) / Hinv[i, i]
        W[:, i:] -= err[:, None] * Hinv[i, i:][None, :]
        Hinv = Hinv - Hinv[:, i:i + 1] @ Hinv[i:i + 1, :] / Hinv[i, i]
    return codes


def test_hessian_is_two_x_xt_over_n():
    X, _ = _data()
    acc = HessianAccumulator(128)
    for chunk in X.split(300):
        acc.add(chunk)
    torch.testing.assert_close(acc.H, 2 * X.T @ X / X.shape[0])


def test_blocked_cholesky_gptq_equals_naive_obs():
    X, W = _data()
    H = 2 * X.T @ X / X.shape[0]
    r = gptq_quantize(W, H, bits=4, group_size=32, damp=0.01, block_size=64)
    ref = _naive_obs(W, H, 32, 0.01)
    agree = (r.quant.codes.double() == ref).double().mean()
    assert agree > 0.999  # float rounding may flip an exact tie or two


@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_beats_rtn_on_output_error(act_order):
    X, W = _data(seed=1)
    H = 2 * X.T @ X / X.shape[0]
    r = gptq_quantize(W, H, 4, 32, act_order=act_order)
    Xf = X.float()

    def out_err(Q):
        return ((Xf @ W.T - Xf @ Q.T) ** 2).sum()

    rtn = out_err(quantize_rtn(W, 4, 32).dequantize())
    assert out_err(r.quant.dequantize()) < 0.6 * rtn
    assert r.gptq_hloss < r.rtn_loss
    g = r.quant.g_idx
    assert g.shape == (128,) and torch.bincount(g.long()).tolist() == [32] * 4
    if act_order:  # loudest column (largest diag(H)) is quantized first -> group 0
        assert g[3] == 0 and not torch.equal(g.long(), torch.arange(128) // 32)


def test_model_gptq_per_layer_report_and_errors(tiny, calib_tokens):
    qm, report = gptq_quantize_model(tiny, calib_tokens, group_size=32, progress=False)
    assert len(report) == 14
    assert all(r["gptq_error"] <= r["rtn_error"] for r in report)
    x = calib_tokens[:2]
    rtn = __import__("labkit.quant", fromlist=["quantize_model"]).quantize_model(
        tiny, "int4_rtn", group_size=32)
    assert (qm(x) - tiny(x)).pow(2).mean() < (rtn(x) - tiny(x)).pow(2).mean()
    with pytest.raises(CalibrationError, match="empty"):
        gptq_quantize_model(tiny, torch.empty(0, 16, dtype=torch.long), progress=False)
    with pytest.raises(CalibrationError, match="only 20 tokens"):
        gptq_quantize_model(tiny, torch.zeros(2, 10, dtype=torch.long), progress=False)
    with pytest.raises(CalibrationError, match=r"\[num_samples, seq_len\]"):
        gptq_quantize_model(tiny, torch.zeros(300, dtype=torch.long), progress=False)

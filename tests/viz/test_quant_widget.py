"""QuantWidget's grids and errors against hand-computed references."""

import pytest
import torch

from labkit.viz.quant import QuantWidget, format_errors, quantize_formats


@pytest.fixture(scope="module")
def weight():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 256, generator=g) * 0.02
    w[3, 5] = 0.3  # one outlier in row 3, group 0
    return w


def test_int4_grid_spans_the_group_min_max(weight):
    q = quantize_formats(weight, group_size=128)
    grid = q["int4_rtn"]["grid"](2, 0)
    group = weight[2, :128]
    lo, hi = min(float(group.min()), 0.0), max(float(group.max()), 0.0)
    assert len(grid) == 16
    step = (hi - lo) / 15
    assert torch.allclose(grid[1:] - grid[:-1], torch.full((15,), grid[1] - grid[0]))
    assert float(grid[1] - grid[0]) == pytest.approx(step, rel=1e-3)  # fp16-rounded scale
    assert float(grid[0]) == pytest.approx(lo, abs=step) and float(grid[-1]) == pytest.approx(
        hi, abs=step)
    # every dequantized int4 weight of that group sits on the grid
    deq = q["int4_rtn"]["deq"][2, :128]
    assert torch.cdist(deq[:, None], grid[:, None]).min(dim=1).values.max() < 1e-6


def test_nf4_grid_is_the_code_times_block_absmax(weight):
    from labkit.quant.nf4 import NF4_CODE

    q = quantize_formats(weight, blocksize=64)
    grid = q["nf4"]["grid"](1, 70)  # row 1, columns 64..127 -> block 1*4 + 1
    absmax = float(weight[1, 64:128].abs().max())
    assert torch.allclose(grid, NF4_CODE * absmax, rtol=1e-6)


def test_errors_rank_formats_and_outliers_hurt(weight):
    q = quantize_formats(weight, group_size=128)
    e = format_errors(weight, q)
    assert e["int8"]["rel_rmse"] < e["int4_rtn"]["rel_rmse"]
    # the outlier stretches row 3's int4 grid: its error is larger than a clean row's
    assert format_errors(weight, q, row=3)["int4_rtn"]["rel_rmse"] > \
        format_errors(weight, q, row=2)["int4_rtn"]["rel_rmse"]
    # rel_rmse is RMSE / RMS, computed by hand for int8 on row 0
    err = q["int8"]["deq"][0] - weight[0]
    want = float(err.pow(2).mean().sqrt() / weight[0].pow(2).mean().sqrt())
    assert format_errors(weight, q, row=0)["int8"]["rel_rmse"] == pytest.approx(want)


def test_quant_widget_redraws(weight):
    w = QuantWidget(torch.nn.Linear(256, 8).requires_grad_(False))
    assert "int4_rtn" in w.summary.value
    w.fmt.value = "nf4"
    assert "nf4" in w.summary.value and len(w.figure.data) == 4
    w.group.value = 1
    assert "columns 128..255" in w.figure.layout.annotations[0].text
    with pytest.raises(ValueError, match="2-D"):
        quantize_formats(torch.zeros(3))

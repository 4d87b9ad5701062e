"""QuantWidget: one weight row against each format's quantization grid, and what rounding costs.

A weight-only format is a grid of representable values per group (INT4: 16 evenly spaced levels
between the group's min and max; NF4: 16 normal quantiles scaled by the block's absmax; INT8 and
FP8: 255 / 253 levels per row). Rounding moves each weight to its nearest level. Seeing the
histogram of real weights under the grid shows why NF4 beats INT4 on bell-shaped weights, why one
outlier stretches a group's grid and wastes levels, and why smaller groups help.
"""

from __future__ import annotations

from typing import Any

import ipywidgets as widgets
import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from labkit.viz.figure_view import FigureView

FORMATS = ("int8", "int4_rtn", "nf4", "fp8")


def quantize_formats(weight: torch.Tensor, group_size: int = 128,
                     blocksize: int = 64) -> dict[str, dict[str, Any]]:
    """Dequantized weight and per-group grids for every format, from labkit.quant itself.

    Returns {fmt: {"deq": [N, K] float32, "grid": fn(row, col) -> sorted levels of the group
    holding weight[row, col]}}.
    """
    from labkit.quant.fp8 import FP8_DTYPE, quantize_fp8
    from labkit.quant.nf4 import NF4_CODE, quantize_nf4
    from labkit.quant.rtn import dequantize_int8, quantize_int8, quantize_rtn

    w = weight.detach().float()
    if w.dim() != 2:
        raise ValueError(f"expected a 2-D weight [out, in], got shape {tuple(w.shape)}")
    out: dict[str, dict[str, Any]] = {}
    q8, s8 = quantize_int8(w)
    out["int8"] = {"deq": dequantize_int8(q8, s8),
                   "grid": lambda r, c: torch.arange(-127, 128).float() * float(s8[r])}
    g4 = quantize_rtn(w, bits=4, group_size=group_size)

    def int4_grid(r: int, c: int) -> torch.Tensor:
        g = int(g4.g_idx[c])
        return (torch.arange(16).float() - float(g4.zeros[g, r])) * float(g4.scales[g, r])

    out["int4_rtn"] = {"deq": g4.dequantize(), "grid": int4_grid}
    nf = quantize_nf4(w, blocksize)
    K = w.shape[1]
    out["nf4"] = {"deq": nf.dequantize(),
                  "grid": lambda r, c: NF4_CODE * float(nf.absmax[(r * K + c) // blocksize])}
    if FP8_DTYPE is not None:
        q, s = quantize_fp8(w)
        levels = torch.arange(256, dtype=torch.uint8).view(FP8_DTYPE).float()
        levels = torch.unique(levels[torch.isfinite(levels)])
        out["fp8"] = {"deq": q.float() * s[:, None], "grid": lambda r, c: levels * float(s[r])}
    return out


def format_errors(weight: torch.Tensor, quantized: dict[str, dict[str, Any]],
                  row: int | None = None) -> dict[str, dict[str, float]]:
    """RMSE and max |error| relative to the weights' RMS, for one row or the whole matrix."""
    w = weight.detach().float()
    sel = (slice(None),) if row is None else (row,)
    ref = w[sel]
    rms = float(ref.pow(2).mean().sqrt()) or 1.0
    out = {}
    for fmt, q in quantized.items():
        err = q["deq"][sel] - ref
        out[fmt] = {"rel_rmse": float(err.pow(2).mean().sqrt()) / rms,
                    "rel_max": float(err.abs().max()) / rms}
    return out


class QuantWidget(widgets.VBox):
    """Histogram of one group of a weight row under a format's grid, plus the error per format.

    `weight`: a 2-D tensor, or an `nn.Linear`. Controls: row, group (input columns), format.
    """

    def __init__(self, weight: Any, group_size: int = 128, blocksize: int = 64,
                 title: str = "") -> None:
        w = weight.weight if hasattr(weight, "weight") else weight
        self.weight = w.detach().float()
        self.group_size = group_size
        self.title = title
        self.quantized = quantize_formats(self.weight, group_size, blocksize)
        N, K = self.weight.shape
        gs = group_size if group_size > 0 else K
        self.row = widgets.IntSlider(description="row", min=0, max=N - 1, value=0)
        self.group = widgets.IntSlider(description="group", min=0, max=max(0, K // gs - 1))
        self.fmt = widgets.ToggleButtons(options=list(self.quantized), value="int4_rtn",
                                         description="format")
        self.summary = widgets.HTML()
        self.view = FigureView("labkit-quant-figure")
        for c in (self.row, self.group, self.fmt):
            c.observe(lambda _: self.redraw(), names="value")
        super().__init__([widgets.HBox([self.row, self.group]), self.fmt, self.summary,
                          self.view])
        self.add_class("labkit-quant")
        self.redraw()

    def redraw(self) -> None:
        r, fmt = self.row.value, self.fmt.value
        K = self.weight.shape[1]
        gs = self.group_size if self.group_size > 0 else K
        c0 = self.group.value * gs
        vals = self.weight[r, c0:c0 + gs]
        deq = self.quantized[fmt]["deq"][r, c0:c0 + gs]
        grid = self.quantized[fmt]["grid"](r, c0)
        lo, hi = float(vals.min()), float(vals.max())
        pad = 0.15 * (hi - lo or 1.0)
        shown = grid[(grid >= lo - pad) & (grid <= hi + pad)]
        errs = format_errors(self.weight, self.quantized, row=r)
        fig = make_subplots(rows=1, cols=2, column_widths=[0.68, 0.32],
                            subplot_titles=(f"row {r}, columns {c0}..{c0 + len(vals) - 1}: "
                                            f"weights and the {fmt} grid",
                                            "relative RMSE of the row"))
        fig.add_trace(go.Histogram(x=vals.tolist(), nbinsx=60, name="weights",
                                   marker_color="#4c78a8", opacity=0.8), row=1, col=1)
        fig.add_trace(go.Histogram(x=deq.tolist(), nbinsx=120, name=f"after {fmt}",
                                   marker_color="#e45756", opacity=0.5), row=1, col=1)
        fig.add_trace(go.Scatter(x=shown.tolist(), y=[0] * len(shown), mode="markers",
                                 marker=dict(symbol="line-ns-open", size=18, color="black"),
                                 name=f"{fmt} levels ({len(shown)} in range)"), row=1, col=1)
        fig.add_trace(go.Bar(x=list(errs), y=[e["rel_rmse"] for e in errs.values()],
                             marker_color=["#e45756" if f == fmt else "#9ecae9" for f in errs],
                             showlegend=False), row=1, col=2)
        fig.update_layout(barmode="overlay", height=380, width=950, plot_bgcolor="white",
                          legend=dict(orientation="h", y=-0.2),
                          margin=dict(l=40, r=20, t=40, b=40))
        fig.update_yaxes(type="log", row=1, col=2)
        self.figure = self.view.show(fig)
        e = errs[fmt]
        self.summary.value = (f"<div>{self.title} <b>{fmt}</b>, row {r}: relative RMSE "
                              f"{e['rel_rmse']:.4f}, worst weight off by {e['rel_max']:.3f}× "
                              f"the row's RMS.</div>")

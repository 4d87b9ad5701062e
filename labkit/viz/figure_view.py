"""FigureView: where every labkit widget draws its plotly figure.

Why not plotly's ``FigureWidget``: it is an anywidget whose state carries plotly.js itself (a
5 MB ES module) in every instance, and the browser evaluates a fresh copy of it for each one.
The widgets redraw by building a new figure per step, so a slider scrub or a Run All of a
notebook with a dozen widgets pushed tens of MB through the kernel websocket and pinned the
browser's main thread; on a 2-core machine the page then missed the server's websocket pings,
the connection dropped, and widgets rendered from half-delivered state as empty axes (issue 19).

An ipywidgets ``Output`` holding the figure as a plotly mime bundle costs only the figure's JSON
per redraw: JupyterLab and Voilà draw it with the plotly.js their ``jupyterlab-plotly``
extension loaded once per page. The output also survives "Save Widget State", so a reopened
notebook shows the last drawing.
"""

from __future__ import annotations

import ipywidgets as widgets
import plotly.graph_objects as go
import plotly.io as pio

PLOTLY_MIME = "application/vnd.plotly.v1+json"


class FigureView(widgets.Output):
    """An output area showing one plotly figure; `show` replaces it. `figure` is the figure
    last shown (a ``go.Figure``), for code and tests that inspect what was drawn."""

    def __init__(self, css_class: str) -> None:
        super().__init__()
        self.add_class(css_class)
        self.figure = go.Figure()

    def show(self, fig: go.Figure) -> go.Figure:
        """Draw `fig` in place of the previous figure; returns `fig`."""
        self.outputs = ({"output_type": "display_data", "data": figure_bundle(fig),
                         "metadata": {}},)
        self.figure = fig
        return fig


def figure_bundle(fig: go.Figure) -> dict:
    """The mime bundle JupyterLab's plotly renderer draws (plus a text fallback)."""
    bundle = pio.renderers["plotly_mimetype"].to_mimebundle(fig.to_dict())
    title = fig.layout.title.text or f"{len(fig.data)} traces"
    return {PLOTLY_MIME: bundle[PLOTLY_MIME], "text/plain": f"<plotly figure: {title}>"}

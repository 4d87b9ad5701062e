"""FigureView: a widget's figure reaches the browser as a plotly mime bundle of that figure, and
no widget tree ships plotly.js in its own state (the 5 MB-per-redraw FigureWidget that made
JupyterLab drop its websocket and draw empty axes, issue 19)."""

import json

import ipywidgets as widgets
import plotly.graph_objects as go
from ipywidgets.widgets.widget import _instances

from labkit.viz import MemoryWidget, PageTableWidget, ScheduleWidget
from labkit.viz.figure_view import PLOTLY_MIME, FigureView

STATE_BUDGET = 512 * 1024   # bytes of synced state for a whole lab-sized widget tree


def _tree_state_bytes(w: widgets.Widget) -> int:
    """JSON size of the synced state of `w` and every widget it contains."""
    total = len(json.dumps(w.get_state(), default=str))
    for child in getattr(w, "children", ()):
        total += _tree_state_bytes(child)
    return total


def test_show_sends_the_figure_itself_as_a_plotly_bundle():
    view = FigureView("labkit-x-figure")
    fig = go.Figure(go.Scatter(x=[0, 1, 2], y=[5, 3, 4], name="s"))
    fig.update_layout(title="t")
    assert view.show(fig) is fig and view.figure is fig
    (out,) = view.outputs
    data = out["data"][PLOTLY_MIME]
    assert data["data"][0]["x"] == [0, 1, 2] and data["data"][0]["y"] == [5, 3, 4]
    assert data["layout"]["title"]["text"] == "t"
    assert "labkit-x-figure" in view._dom_classes
    json.dumps(view.get_state())   # the bundle is plain JSON, sendable as widget state


def test_widget_trees_stay_small_and_redraws_make_no_new_widgets(trace):
    for w in (PageTableWidget(trace), ScheduleWidget(trace), MemoryWidget(trace)):
        size = _tree_state_bytes(w)
        assert size < STATE_BUDGET, f"{type(w).__name__} syncs {size:,} bytes of state"
    pt = PageTableWidget(trace, step=0)
    before = set(_instances)
    drawn = pt.view.outputs
    pt.slider.value = pt.slider.max
    assert set(_instances) == before, "a redraw created widgets (each one is sent to the browser)"
    assert pt.view.outputs != drawn and pt.view.outputs[0]["data"][PLOTLY_MIME]["data"][0][
        "marker"]["color"] == list(pt.figure.data[0].marker.color)

"""Figures sit right under their cell: labkit.viz layers a template with a 50 px top margin on
plotly's default (plotly.js's own is 100 px, the empty band issue 27's browser pass saw)."""

import plotly.graph_objects as go
import plotly.io as pio


def test_importing_labkit_viz_gives_figures_a_small_top_margin():
    import labkit.viz  # noqa: F401
    from labkit.viz import theme

    assert pio.templates.default.split("+")[-1] == "labkit"
    fig = go.Figure(go.Scatter(x=[0, 1], y=[1, 2]))
    template = pio.templates[pio.templates.default]  # what a plain fig.show() gets
    assert template.layout.margin.t == 50 < 100
    assert fig.to_dict()["layout"]["template"]["layout"]["margin"]["t"] == 50
    theme.install()  # idempotent: not "plotly+labkit+labkit"
    assert pio.templates.default.count("labkit") == 1

"""The lab's plotly defaults, installed when ``labkit.viz`` is imported.

plotly.js leaves a 100 px top margin on every figure (room for a title most of the lab's
figures do not have), so in a notebook each plain ``fig.show()`` sat about 100 px below the
cell that made it (issue 27's browser pass, notebooks 01, 05 and 07). The ``labkit`` template
keeps 50 px: enough for a one-line title, no empty band without one. It is layered on the
default template (``"plotly+labkit"``), so colours and fonts stay plotly's.
"""

from __future__ import annotations

import plotly.graph_objects as go
import plotly.io as pio

MARGIN = {"t": 50, "b": 50, "l": 60, "r": 30}


def install() -> None:
    """Register the ``labkit`` template and layer it on the current default (idempotent)."""
    pio.templates["labkit"] = go.layout.Template(layout={"margin": MARGIN})
    parts = str(pio.templates.default).split("+")
    if "labkit" not in parts:
        pio.templates.default = "+".join([*parts, "labkit"])

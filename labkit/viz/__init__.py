"""labkit.viz — Jupyter widgets that replay an engine Trace.

Every widget takes a trace (dict, `Trace`, `SimResult` or `LLMEngine`), so it works on any run,
including one the learner makes. Needs the `lab` extra (ipywidgets 8, plotly, anywidget).
"""

from labkit.viz import theme
from labkit.viz.kv_groups import KVGroupsWidget
from labkit.viz.kv_tiers import KVTierWidget
from labkit.viz.latency import LatencyWidget
from labkit.viz.memory import MemoryWidget
from labkit.viz.moe import ExpertLoadWidget, TokenRoutingWidget
from labkit.viz.page_table import PageTableWidget
from labkit.viz.prefix_tree import PrefixTreeWidget
from labkit.viz.quant import QuantWidget
from labkit.viz.schedule import ScheduleWidget
from labkit.viz.spec import SpecWidget

theme.install()  # plotly's 100 px top margin put every figure far below its cell

__all__ = [
    "ExpertLoadWidget", "KVGroupsWidget", "KVTierWidget", "LatencyWidget", "MemoryWidget",
    "PageTableWidget", "PrefixTreeWidget", "QuantWidget", "ScheduleWidget", "SpecWidget",
    "TokenRoutingWidget",
]

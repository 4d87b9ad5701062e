"""The step timeline draws exactly the profiler's numbers, and its slider re-slices them."""

import pytest

import labkit
from labkit.engine.profiler import PHASES
from labkit.viz.step_timeline import StepTimelineWidget


@pytest.fixture(scope="module")
def profiler():
    llm = labkit.LLM("labkit-tiny", dtype="float32", profile=True)
    sp = labkit.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    llm.generate(["def f(x):", "import re"], sp)
    return llm.profiler


def test_bars_are_the_profiled_milliseconds_and_shares(profiler):
    w = StepTimelineWidget(profiler)
    steps = list(profiler.steps)
    per_step = {t.name: t for t in w.fig.data if t.orientation != "h"}
    share = {t.y[0]: t.x[0] for t in w.fig.data if t.orientation == "h"}
    assert list(per_step) == list(PHASES) and set(share) == set(PHASES)
    for p in PHASES:
        assert list(per_step[p].y) == pytest.approx([1e3 * s.phases[p] for s in steps])
    assert sum(share.values()) == pytest.approx(1.0)
    assert share["forward"] == pytest.approx(sum(s.phases["forward"] for s in steps)
                                             / sum(s.wall for s in steps))


def test_the_slider_chooses_the_steps(profiler):
    w = StepTimelineWidget(profiler)
    w.slider.value = (1, 2)
    xs = next(t for t in w.fig.data if t.name == "forward").x
    assert list(xs) == [1, 2]
    with pytest.raises(ValueError, match="no profiled steps"):
        StepTimelineWidget([])

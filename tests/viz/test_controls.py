"""Controls re-run the simulator / the tiny engine and the widgets follow in place."""

import pytest

from labkit.viz.controls import SimulatorControls, SpecControls


@pytest.fixture(scope="module")
def sim():
    return SimulatorControls(model="llama-3.2-1b", gpu="rtx-4090", workload="alpaca",
                             num_requests=12, block_size=16)


def test_simulator_controls_rerun_on_change(sim):
    first = sim.result
    schedule, page_table = sim.schedule, sim.page_table
    assert first.trace.meta["block_size"] == 16
    sim.block_size.value = 32
    assert sim.result is not first
    assert sim.result.trace.meta["block_size"] == 32
    assert sim.schedule is schedule and sim.page_table is page_table  # updated in place
    assert page_table.block_size == 32
    assert page_table.slider.max == len(sim.result.trace.steps) - 1
    sim.batching.value = "static"
    assert sim.result.trace.meta["batching"] == "static"
    assert "static batching" in sim.schedule.summary.value
    assert "requests finished" in sim.metrics.value


def test_simulator_controls_without_auto_wait_for_run(sim):
    sim.auto.value = False
    before = sim.result
    sim.num_requests.value = 5
    assert sim.result is before
    sim.run_button.click()
    assert len(sim.result.trace.requests) == 5
    sim.auto.value = True


def test_simulator_controls_report_a_model_that_does_not_fit():
    c = SimulatorControls(model="llama-2-70b", gpu="rtx-4090", num_requests=2)
    assert c.result is None
    assert "cannot simulate" in c.status.value


def test_spec_controls_follow_gamma():
    c = SpecControls(["def fibonacci(n):"], max_tokens=8, num_blocks=32, gamma=3)
    steps = [e for r in c.engine.trace.steps for e in r["spec"]]
    assert steps and all(len(e["proposed"]) <= 3 for e in steps)
    assert any(len(e["proposed"]) == 3 for e in steps)
    c.gamma.value = 1
    steps = [e for r in c.engine.trace.steps for e in r["spec"]]
    assert all(len(e["proposed"]) <= 1 for e in steps)
    assert "γ = 1" in c.status.value
    with pytest.raises(ValueError, match="prompt"):
        SpecControls([])

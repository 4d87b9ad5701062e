"""MIG instances and time-slicing in the simulator (labkit.sim.isolation)."""

from __future__ import annotations

import numpy as np
import pytest

from labkit.sim.isolation import (
    Tenant,
    compare,
    mig_instance,
    p99_ms,
    run_partitioned,
    run_time_sliced,
)
from labkit.sim.presets import get_gpu
from labkit.sim.workloads import RequestSpec


def _specs(rate: float, n: int, seed: int) -> list[RequestSpec]:
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1 / rate, n))
    return [RequestSpec(int(rng.integers(256, 768)), int(rng.integers(32, 96)), float(t[i]),
                        seed=seed * 1000 + i) for i in range(n)]


def test_mig_instance_is_the_profiles_share_of_the_gpu():
    g = get_gpu("h100-sxm")
    s = mig_instance("h100", "3g.40gb")
    assert s.peak_flops == pytest.approx(g.peak_flops * 3 / 7, rel=1e-12)
    assert s.mem_bandwidth == pytest.approx(g.mem_bandwidth * 4 / 8, rel=1e-12)
    assert s.mem_bytes == 40 * 10**9
    assert mig_instance("h200", "1g.18gb").mem_bandwidth == pytest.approx(4.8e12 / 8, rel=1e-12)
    with pytest.raises(ValueError, match="no MIG profile"):
        mig_instance("h100", "3g.71gb")
    with pytest.raises(ValueError, match="no MIG profiles"):
        mig_instance("rtx-4090", "1g.10gb")


def test_time_slicing_one_tenant_is_that_tenant_alone_on_the_gpu():
    """With nobody to take turns with, the time-sliced loop is a plain run on the whole GPU."""
    t = Tenant("a", _specs(4.0, 30, 1))
    g = get_gpu("h100-sxm")
    alone, _ = run_partitioned("llama-3-8b", [t], [g])
    sliced, _ = run_time_sliced("llama-3-8b", [t], g)
    assert [r["ttft"] for r in sliced] == pytest.approx([r["ttft"] for r in alone], rel=1e-9)


def test_a_mig_tenant_does_not_feel_its_neighbour_but_a_time_sliced_one_does():
    light = Tenant("light", _specs(2.0, 20, 1))
    calm, busy = Tenant("heavy", _specs(2.0, 20, 2)), Tenant("heavy", _specs(20.0, 200, 3))
    slices = [mig_instance("h100", "3g.40gb"), mig_instance("h100", "4g.40gb")]
    rows_calm, _ = run_partitioned("llama-3-8b", [light, calm], slices)
    rows_busy, _ = run_partitioned("llama-3-8b", [light, busy], slices)
    assert p99_ms(rows_calm, "light") == p99_ms(rows_busy, "light")
    g = get_gpu("h100")
    ts_calm, _ = run_time_sliced("llama-3-8b", [light, calm], g)
    ts_busy, busy_s = run_time_sliced("llama-3-8b", [light, busy], g)
    assert p99_ms(ts_busy, "light") > p99_ms(ts_calm, "light")
    # one step at a time: the GPU is never busier than the span of the run
    assert busy_s <= max(r["finish"] for r in ts_busy)


def test_compare_reports_both_layouts():
    tenants = [Tenant("light", _specs(2.0, 12, 1)), Tenant("heavy", _specs(20.0, 120, 2))]
    out = compare("llama-3-8b", "h100-sxm", tenants, ["3g.40gb", "4g.40gb"])
    for k in ("mig_light_p99_ms", "time_sliced_light_p99_ms", "mig_heavy_p99_ms",
              "time_sliced_heavy_p99_ms"):
        assert out[k] > 0
    assert 0 <= out["time_sliced_idle_compute"] <= 1 and 0 <= out["mig_idle_compute"] <= 1

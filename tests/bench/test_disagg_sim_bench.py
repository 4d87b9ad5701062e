"""disagg-sim bench at toy size: the payload's keys and internal consistency (the simulator's
own behaviour is tested in tests/sim/test_disagg.py)."""

from labkit.bench import disagg_sim


def test_quick_run_toy_sizes():
    sizes = {"num_requests": 150, "links": ("nvlink4",), "sweep_points": 2}
    out = disagg_sim.run(quick=True, sizes=sizes)
    assert set(out["frontier"]) == set(disagg_sim.SLOS)
    for t in out["kv_transfer"]:  # Llama-3-8B: 128 KiB of K and V per token
        assert t["kv_bytes"] == t["prompt_tokens"] * 131072
    for label, f in out["frontier"].items():
        names = [r["deployment"] for r in f["rows"]]
        assert names == ["colocated x1", "colocated x2", "1P:1D nvlink4", "1P:2D nvlink4",
                         "2P:1D nvlink4"]
        for r in f["rows"]:
            assert r["goodput_per_gpu"] * r["gpus"] == r["goodput_rps"] > 0
        assert all(0 <= r["attainment"] <= 1 for r in out["sweep"][label])
    assert out["generous_best"] in names and out["tight_best"] in names

"""lora bench: the --quick path end to end at toy sizes on a tiny random checkpoint (keys,
outputs equal run-alone, the adapters changing outputs; never timings)."""

import json

from labkit.bench import lora as lora_bench


def test_quick_run_writes_ratios_and_matching_outputs(tiny_ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr(lora_bench, "QUICK", {"num_requests": 8, "num_adapters": 4,
                                              "max_tokens": 4, "repeats": 1})
    out = tmp_path / "lora.json"
    assert lora_bench.main(["--quick", "--json", str(out), "--model", str(tiny_ckpt),
                            "--writer", "labkit"]) == 0
    r = json.loads(out.read_text())
    assert r["outputs_match"] is True and r["sequential_outputs_match"] is True
    assert r["adapters_change_outputs"] > 0  # the random adapters are not the base model
    assert r["output_tokens"] == {"mixed": 32, "sequential": 32, "base": 32}
    assert r["mixed_vs_sequential"] > 0 and r["mixed_vs_base"] > 0
    assert r["slot_stats"]["disk_loads"] == 4
    env = r["environment"]
    assert len(env["load_average_at_start"]) == 3 and len(env["load_average_at_end"]) == 3

"""``labkit bench engine-gpu`` on a CPU with the tiny shape: the code path the GPU run takes,
checked against independent references (transformers' greedy tokens, the simulator presets'
own parameter counts); its speeds are not asserted (a benchmark's business, not a test's)."""

from __future__ import annotations

import json

import pytest

from labkit.bench import engine_gpu
from labkit.sim.presets import get_model_preset


@pytest.mark.parametrize("name", ["llama-3.2-1b", "llama-3-8b", "qwen2.5-7b", "llama-2-70b"])
def test_model_config_has_the_presets_shape(name):
    p = get_model_preset(name)
    assert engine_gpu.model_config(p).num_parameters() == p.num_params


@pytest.fixture(scope="module")
def payload():
    cfg = {"num_requests": 12, "batch_sizes": (4,), "max_prompt_len": 64,
           "max_output_len": 48, "prefix_len": 256, "suffix_len": 16, "prefix_requests": 3}
    return engine_gpu.run("tiny", device="cpu", dtype="float32", cfg=cfg)


@pytest.mark.slow
def test_every_path_gives_the_same_greedy_tokens(payload):
    (row,) = payload["batching"]
    assert row["num_requests"] == 12
    assert row["same_tokens"] == 12  # continuous == static, token for token
    assert row["same_tokens_as_hf"] == 12  # == transformers' generate on the same weights
    assert row["continuous_preemptions"] == row["static_preemptions"] == 0  # pool fits
    for k in ("continuous_tokens_per_s", "static_tokens_per_s", "hf_tokens_per_s",
              "sim_continuous_tokens_per_s", "sim_static_tokens_per_s"):
        assert row[k] > 0, k
    assert row["sim_error_continuous"] == pytest.approx(
        row["sim_continuous_tokens_per_s"] / row["continuous_tokens_per_s"])


@pytest.mark.slow
def test_prefix_cache_hits_only_when_on(payload, tmp_path):
    f = payload["prefix"]
    # 1 + 3 requests of 256 shared + 16 own tokens = 17 blocks of 16 each; the first misses
    # all 17, each later one hits the 16 system-prompt blocks: 48 of 68
    assert f["hit_rate_cache_off"] == 0.0
    assert f["hit_rate_cache_on"] == pytest.approx(48 / 68)
    assert f["sim_ttft_ms_cache_on"] <= f["sim_ttft_ms_cache_off"]
    md = engine_gpu.report_md(payload)
    assert "| 4 |" in md and "Prefix caching (256-token system prompt" in md
    json.dumps(payload, default=float)  # what --json writes


@pytest.mark.slow
def test_triton_backend_path_gives_the_torch_tokens():
    """The GPU run's default backend, here through Triton's interpreter (conftest sets it)."""
    import torch

    p = engine_gpu.TINY
    model = engine_gpu.random_model(p, torch.float32, "cpu")
    specs = engine_gpu.chat_requests(p, 4, 32, 8, seed=0)
    ref = engine_gpu.batching(model, p, specs, 4, "h200", "cpu", "torch")
    tri = engine_gpu.batching(model, p, specs, 4, "h200", "cpu", "triton")
    assert tri["_outputs"] == ref["_outputs"] and tri["same_tokens"] == 4


@pytest.mark.parametrize("argv,says", [
    (["--shape", "nope"], "unknown model preset"),
    (["--shape", "tiny", "--batch-sizes", "x"], "--batch-sizes takes positive integers"),
    (["--shape", "tiny", "--num-requests", "0"], "--num-requests must be >= 1"),
])
def test_bad_arguments_are_named(argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        engine_gpu.main(argv)
    assert e.value.code == 2 and says in capsys.readouterr().err

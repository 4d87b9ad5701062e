"""prefix bench: the quick path at toy sizes (keys and invariants, never timings)."""

from labkit.bench import prefix


def test_quick_run_toy_sizes(tiny_ckpt):
    sizes = {"num_prompts": 4, "max_tokens": 2, "sequential": 2, "sim_requests": 20}
    out = prefix.run(tiny_ckpt, quick=True, sizes=sizes)
    for key in ("ttft_p50_cache_off", "ttft_p50_cache_on", "hit_rate"):
        assert key in out
    off, on = out["real"]
    assert not off["cache"] and on["cache"]
    assert off["hit_rate"] == 0.0 and 0 < on["hit_rate"] <= 1
    # With the system prompt cached, only the suffixes (plus block remainders) are prefilled.
    assert on["prefill_tokens"] < off["prefill_tokens"]
    # Cache off: every prompt token of the burst is prefilled exactly once.
    assert off["prefill_tokens"] == round(off["prompt_len_mean"] * off["num_prompts"])
    assert out["shared_prefix_fraction"] >= 0.5
    sim_off, sim_on = out["sim"]
    assert sim_on["prefill_tokens"] < sim_off["prefill_tokens"]

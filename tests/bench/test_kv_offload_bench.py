"""kv-offload bench at toy size: outputs equal across configurations, the tiers' hit rates in
the order the mechanism guarantees, and token counts that agree between the scheduler's
bookkeeping, the engine's trace and a from-the-tokens reference (never timings)."""

from labkit.bench import kv_offload

SIZES = {"conversations": 3, "turns": 3, "system_len": 16, "user_len": 10, "max_tokens": 4,
         "block_size": 8}


def test_ideal_hit_tokens_by_hand():
    # block 4: request 2 repeats request 1's first 5 tokens (one full block, not its last
    # token); request 3 repeats request 2's prompt + reply[:-1] = 8 tokens (2 blocks).
    p1, r1 = [1, 2, 3, 4, 5, 6], [7, 8]
    p2, r2 = [1, 2, 3, 4, 9, 9, 9], [5, 5]
    p3 = [1, 2, 3, 4, 9, 9, 9, 5, 0]
    assert kv_offload.ideal_hit_tokens([p1, p2, p3], [r1, r2, [0]], 4) == 0 + 4 + 8


def test_quick_run_toy_sizes(tiny_ckpt):
    out = kv_offload.run(tiny_ckpt, quick=True, sizes=SIZES)
    assert out["outputs_match"] is True
    assert out["workload_over_pool"] > 2
    rows = {r["config"]: r for r in out["configs"]}
    assert list(rows) == list(kv_offload.CONFIGS)
    prompt_tokens = rows["no-cache"]["prompt_tokens"]
    for r in rows.values():
        assert r["prompt_tokens"] == prompt_tokens  # same outputs -> same histories
        # The trace's prefill tokens are exactly the prompt tokens the scheduler did not count
        # as cached (one request at a time, so no prefill is split or repeated).
        assert r["computed_prefill_tokens"] == prompt_tokens - r["cached_tokens"]
    hit = out["hit_rate"]
    assert hit["no-cache"] == 0.0
    # A tier only extends the device match (the device pool evolves identically), and a store
    # that never evicts holds every block ever computed: the ideal, computed from the tokens.
    assert 0 < hit["device"] <= hit["device+cpu"] <= hit["device+cpu+disk"]
    assert rows["device+cpu+disk"]["cached_tokens"] == out["ideal_hit_tokens"]
    assert hit["device"] < hit["device+cpu+disk"]  # the pool really is too small
    comp = out["computed_prefill_tokens"]
    assert comp["no-cache"] > comp["device"] >= comp["device+cpu"] >= comp["device+cpu+disk"]
    assert comp["device"] > comp["device+cpu+disk"]
    bs = SIZES["block_size"]
    for name in ("device+cpu", "device+cpu+disk"):
        t = rows[name]["tiers"]
        loaded = t["cpu"]["loads"] + t.get("disk", {}).get("loads", 0)
        assert bs * (t["device"]["hits"] + loaded) == rows[name]["cached_tokens"]
        # ... and the device part is exactly device-only caching's: same pool, same evictions.
        assert bs * t["device"]["hits"] == rows["device"]["cached_tokens"]
    # The disk configuration's CPU tier is too small to keep the history: loads come from disk.
    assert rows["device+cpu+disk"]["tiers"]["disk"]["loads"] > 0

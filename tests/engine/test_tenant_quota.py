"""Per-tenant quotas (labkit.sched.quota) in the engine: no tenant ever runs more sequences or
starts holding more blocks than its cap, a light tenant starts while a heavy one is capped, a
lone request bigger than the cap still runs, and greedy output is unchanged (a quota reorders,
it never changes what a request computes)."""

from __future__ import annotations

import pytest

from labkit.engine.invariants import assert_no_leaks
from labkit.engine.llm_engine import LLMEngine
from labkit.engine.sampling_params import SamplingParams
from labkit.errors import EngineConfigError
from labkit.model.generate import generate
from labkit.sched.policies_fair import tenant_of
from labkit.sched.quota import AllOf, TenantQuota, combine

SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def run(tiny_model, prompts, salts, **kw):
    """Drive the engine step by step; per step, each tenant's running sequences and blocks."""
    eng = LLMEngine.from_model(tiny_model, None, block_size=4, max_num_seqs=8, **kw)
    for i, (p, salt) in enumerate(zip(prompts, salts)):
        eng.add_request(f"r{i}", p, SP, cache_salt=salt)
    per_step, out, started = [], {}, {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
        run_now = eng.scheduler.running
        per_step.append({t: (sum(tenant_of(s) == t for s in run_now),
                             sum(len(s.block_table) for s in run_now if tenant_of(s) == t))
                         for t in set(salts)})
        for s in run_now:
            started.setdefault(s.request_id, len(per_step))
    assert_no_leaks(eng)
    return eng, per_step, out, started


def test_running_cap_holds_and_a_light_tenant_gets_in(tiny_model, prompts):
    heavy, light = prompts[:5], prompts[6:7]
    salts = ["heavy"] * 5 + ["light"]
    eng, steps, out, started = run(tiny_model, heavy + light, salts, tenant_max_running=2)
    assert max(s["heavy"][0] for s in steps) == 2  # capped, and the cap was reached
    assert started["r5"] == 1  # the light tenant started in the first step
    assert eng.scheduler.quota.refused > 0
    _, free_steps, free_out, _ = run(tiny_model, heavy + light, salts)
    assert max(s["heavy"][0] for s in free_steps) == 5  # negative control: no quota, no cap
    for i, p in enumerate(heavy + light):  # same tokens as the reference, with or without
        want = generate(tiny_model, p, 6, ignore_eos=True)
        assert out[f"r{i}"] == free_out[f"r{i}"] == want


def test_block_cap_bounds_what_a_tenant_holds_when_it_starts_one(tiny_model, prompts):
    ps = [prompts[2], prompts[5], prompts[6], prompts[0]]   # 23, 32, 12, 5 tokens
    eng, steps, out, _ = run(tiny_model, ps, ["a"] * 4, tenant_max_kv_blocks=10)
    assert all(len(out[f"r{i}"]) == 6 for i in range(4))
    assert eng.scheduler.quota.refused > 0
    # each admission respected the cap: at a step where a sequence started, the tenant held at
    # most 10 blocks, or it was that tenant's only running sequence (progress, not starvation)
    def over_cap(steps):  # a start that left the tenant holding more than cap + growth
        return [now for before, now in zip([{"a": (0, 0)}] + steps, steps)
                if now["a"][0] > before["a"][0] and now["a"][0] > 1
                and now["a"][1] > 10 + now["a"][0]]

    assert not over_cap(steps)
    assert over_cap(run(tiny_model, ps, ["a"] * 4)[1])  # negative control: no quota
    with pytest.raises(EngineConfigError):
        LLMEngine.from_model(tiny_model, None, tenant_max_running=0)


def test_policies_combine():
    class No:
        def can_run(self, seq, running):
            return False

    q = TenantQuota(max_running=1)
    assert combine(None, None) is None and combine(None, q) is q
    both = combine(No(), q)
    assert isinstance(both, AllOf) and both.policies[1] is q


def test_serve_flags_reach_the_scheduler():
    from labkit.serve.engine_core import build_engine
    from labkit.serve.launcher import ENGINE_FLAGS, build_parser

    args = build_parser().parse_args(["labkit-tiny", "--tenant-max-running", "2",
                                      "--tenant-max-kv-blocks", "40", "--num-blocks", "64"])
    kw = {k: getattr(args, k) for k in ENGINE_FLAGS}
    eng, _, _ = build_engine("labkit-tiny", **kw)
    q = eng.scheduler.quota
    assert (q.max_running, q.max_kv_blocks, q.block_size) == (2, 40, eng.config.cache.block_size)

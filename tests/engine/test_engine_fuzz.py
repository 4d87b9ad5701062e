"""Random engine configurations and workloads (with aborts) against the reference generate.

Each trial draws a block size, pool size, chunking / prefix caching / policy / batching /
preemption mode and a handful of requests (shared prefixes, n up to 3, greedy or seeded
sampling, stop ids, EOS), runs the engine to the end with random aborts, and checks every
non-aborted sample token for token, then that the pool holds nothing.
"""

from __future__ import annotations

import random

import pytest

from labkit.engine.invariants import assert_no_leaks, check_kv_invariants
from labkit.engine.llm_engine import LLMEngine
from labkit.engine.sampling_params import SamplingParams
from labkit.errors import EngineStepError
from labkit.model.generate import generate
from labkit.model.testing import tiny_model

WINDOWS = {  # sliding layers: none, every layer (Mistral), some (per-layer layer_types)
    "llama": {},
    "mistral-window6": dict(sliding_window=6, architecture="MistralForCausalLM"),  # frees blocks
    "per-layer-window6": dict(sliding_window=6, layer_types=["full_attention",
                                                             "sliding_attention"]),
}


@pytest.fixture(scope="module", params=list(WINDOWS))
def model(request):
    return tiny_model(0, max_position_embeddings=64, eos_token_id=5, **WINDOWS[request.param])


def random_engine(model, rng):
    bs = rng.choice([1, 2, 3, 4, 7, 16])
    mode = rng.choice(["recompute", "swap"])
    kw = dict(block_size=bs, num_blocks=rng.randint(64 // bs + 2, 200 // bs + 4),
              enable_prefix_caching=rng.random() < 0.7, enable_chunked_prefill=rng.random() < 0.7,
              policy=rng.choice(["fcfs", "priority", "sjf"]), max_num_seqs=rng.randint(1, 8),
              batching=rng.choice(["continuous", "continuous", "static"]), preemption_mode=mode,
              num_cpu_blocks=100 if mode == "swap" else 0)
    if kw["enable_chunked_prefill"]:
        kw["max_num_batched_tokens"] = rng.randint(1, 40)
    return LLMEngine.from_model(model, None, **kw)


@pytest.mark.parametrize("trial", range(20))
def test_random_configs_match_reference(model, trial):
    rng = random.Random(trial)
    eng = random_engine(model, rng)
    shared = [rng.randrange(128) for _ in range(rng.randint(1, 20))]
    reqs = {}
    for i in range(rng.randint(2, 8)):
        p = (shared if rng.random() < 0.5 else []) + [
            rng.randrange(128) for _ in range(rng.randint(1, 30))]
        sp = SamplingParams(n=min(rng.choice([1, 1, 2, 3]), eng.config.scheduler.max_num_seqs),
                            temperature=rng.choice([0, 0.8]), top_k=rng.choice([0, -1, 10]),
                            top_p=rng.choice([1.0, 0.8]), seed=rng.randrange(1000),
                            max_tokens=rng.randint(1, 12), ignore_eos=rng.random() < 0.5,
                            stop_token_ids=rng.choice([[], [7]]))
        try:
            eng.add_request(f"r{i}", p, sp, priority=rng.randrange(3))
        except ValueError:
            continue  # e.g. cannot fit this trial's pool: rejected up front, as it must be
        reqs[f"r{i}"] = (p, sp)
    aborted = set()
    for _ in range(3000):
        if not eng.has_unfinished_requests():
            break
        if rng.random() < 0.02:
            rid = rng.choice(sorted(reqs))
            eng.abort(rid)
            aborted.add(rid)
        eng.step()
        check_kv_invariants(eng)
    assert not eng.has_unfinished_requests()
    for rid, (p, sp) in reqs.items():
        if rid in aborted:
            continue
        for s in eng.requests[rid].seqs:
            want = generate(model, p, sp.max_tokens, sp.temperature, sp.top_k, sp.top_p,
                            sp.seed + s.index if sp.temperature else None, sp.stop_token_ids,
                            sp.ignore_eos)
            assert s.output_token_ids == want, (rid, s.seq_id)
    assert_no_leaks(eng)


@pytest.fixture(scope="module")
def draft():
    return tiny_model(1, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      eos_token_id=5)


@pytest.mark.parametrize("trial", range(24))
def test_stress_greedy_tight_pool_spec_and_failures(model, draft, trial):
    """Greedy under stress: pools barely larger than one full sequence (constant preemption,
    swap spaces too small to hold a victim), n up to 4, speculative decoding on some trials,
    random arrivals between steps, random aborts and an injected failing step. Every sample
    that was neither aborted nor failed equals the reference; the pool balances every step
    and is empty at the end."""
    rng = random.Random(1000 + trial)
    bs = rng.choice([1, 2, 3, 4, 7, 16])
    mode = rng.choice(["recompute", "swap"])
    spec = rng.choice([None, "ngram", "draft"])
    gamma = rng.choice([1, 3, 5])
    kw = dict(block_size=bs, num_blocks=rng.randint(-(-(64 + gamma) // bs), 64 // bs + 8),
              enable_prefix_caching=rng.random() < 0.7, enable_chunked_prefill=rng.random() < 0.7,
              policy=rng.choice(["fcfs", "priority", "sjf"]), max_num_seqs=rng.randint(1, 8),
              batching=rng.choice(["continuous", "continuous", "static"]), preemption_mode=mode,
              num_cpu_blocks=rng.choice([3, 100]) if mode == "swap" else 0)
    if kw["enable_chunked_prefill"]:
        kw["max_num_batched_tokens"] = rng.randint(1, 40)
    if spec:
        kw["speculative_config"] = {"method": "ngram", "num_speculative_tokens": gamma} \
            if spec == "ngram" else {"method": "draft_model", "model": draft,
                                     "num_speculative_tokens": gamma}
    eng = LLMEngine.from_model(model, None, **kw)
    fail_at = rng.randint(1, 30) if rng.random() < 0.5 else 0
    runner = eng.executor.runner
    forward, calls = runner.forward, [0]

    def flaky(*a, **k):
        calls[0] += 1
        if calls[0] == fail_at:
            raise RuntimeError("injected")
        return forward(*a, **k)

    runner.forward = flaky
    shared = [rng.randrange(128) for _ in range(rng.randint(1, 20))]
    todo = []
    for i in range(rng.randint(2, 8)):
        p = (shared if rng.random() < 0.5 else []) + [
            rng.randrange(8 if spec else 128) for _ in range(rng.randint(1, 30))]
        todo.append((f"r{i}", p, SamplingParams(n=min(rng.choice([1, 1, 2, 4]), kw["max_num_seqs"]),
                                                temperature=0, max_tokens=rng.randint(1, 40),
                                                ignore_eos=rng.random() < 0.7)))
    reqs, aborted, failed = {}, set(), set()
    for _ in range(3000):
        while todo and (not reqs or rng.random() < 0.3):  # arrivals between steps
            rid, p, sp = todo.pop(0)
            try:
                eng.add_request(rid, p, sp, priority=rng.randrange(3))
                reqs[rid] = (p, sp)
            except ValueError:
                pass  # cannot fit this trial's pool: rejected up front
        if not todo and not eng.has_unfinished_requests():
            break
        if reqs and rng.random() < 0.02:
            rid = rng.choice(sorted(reqs))
            eng.abort(rid)
            aborted.add(rid)
        try:
            eng.step()
        except EngineStepError as e:
            failed.update(e.request_ids)
        check_kv_invariants(eng)
    assert_no_leaks(eng)
    for rid, (p, sp) in reqs.items():
        if rid in aborted or rid in failed:
            continue
        want = generate(model, p, sp.max_tokens, ignore_eos=sp.ignore_eos)
        for s in eng.requests[rid].seqs:
            assert s.output_token_ids == want, (rid, s.seq_id)

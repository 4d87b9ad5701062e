"""batching bench: pure helpers against hand counts, the transformers baseline against labkit's
reference generate, and the whole quick path at toy sizes (keys and invariants, never timings)."""

import pytest
import torch

from labkit.bench import batching
from labkit.model.generate import generate
from labkit.model.loader import load_pretrained


def test_static_step_bound_hand_computed():
    # Batches of 2: [1, 3] -> 3 steps, [2, 2] -> 2 steps; static 5 vs packed 8 / 2 = 4.
    assert batching.static_step_bound([1, 3, 2, 2], 2) == pytest.approx(5 / 4)
    # Equal lengths: no gain to be had.
    assert batching.static_step_bound([7] * 8, 4) == pytest.approx(1.0)
    # Fewer requests than the batch: both run one batch as long as the longest request.
    assert batching.static_step_bound([1, 9, 2], 8) == pytest.approx(1.0)


def test_make_requests_seeded_and_long_tailed(tiny_ckpt):
    _, tok = load_pretrained(tiny_ckpt)
    p1, m1 = batching.make_requests(tok, 200, 40, 400, seed=3)
    p2, m2 = batching.make_requests(tok, 200, 40, 400, seed=3)
    assert (p1, m1) == (p2, m2)
    assert 1 <= min(m1) and max(m1) <= 400 and max(m1) > 3 * (sum(m1) / len(m1))


def test_hf_padded_batches_equal_reference_generate(tiny_ckpt):
    torch.manual_seed(0)
    model, tok = load_pretrained(tiny_ckpt)
    prompts, max_tokens = batching.make_requests(tok, 6, 6, 12, seed=1)
    res = batching.run_hf(tiny_ckpt, prompts, max_tokens, batch_size=4)
    ref = [generate(model, p, m, ignore_eos=True) for p, m in zip(prompts, max_tokens)]
    assert res["outputs"] == ref
    assert res["output_tokens"] == sum(max_tokens)
    # Padded static batches compute at least the useful tokens.
    assert res["computed_tokens"] >= res["output_tokens"]


def test_quick_run_toy_sizes(tiny_ckpt):
    sizes = {"num_requests": 6, "batch_size": 3, "output_mean": 6, "output_max": 16,
             "sweep_requests": 24, "sweep_sigmas": (0.0, 1.0), "sweep_batch": 4,
             "repeats": 1}
    out = batching.run(tiny_ckpt, quick=True, sizes=sizes)
    for key in ("continuous_tokens_per_s", "static_tokens_per_s", "hf_tokens_per_s",
                "outputs_match"):
        assert key in out
    assert out["outputs_match"] is True
    assert out["static_outputs_match_continuous"] is True
    assert all(out[k] > 0 for k in ("continuous_tokens_per_s", "static_tokens_per_s",
                                    "hf_tokens_per_s"))
    # Static batching never needs fewer engine steps than continuous batching.
    assert out["steps"]["static"] >= out["steps"]["continuous"]
    sweep = out["sim_sweep"]
    assert {r["model"] for r in sweep} == set(batching.SWEEP_MODELS)
    for r in sweep:
        if r["output_sigma"] == 0.0:
            assert r["step_bound"] == pytest.approx(1.0)  # equal lengths: nothing to gain
            assert r["speedup"] == pytest.approx(1.0, abs=0.05)
        else:
            assert r["step_bound"] > 1.0
        assert r["speedup"] > 0

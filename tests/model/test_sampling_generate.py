"""Sampling filters against hand-computed distributions; generate's contract and errors."""

import pytest
import torch
from scipy import stats

from labkit.model import generate
from labkit.model.sampling import apply_sampling_filters, sample_token
from labkit.model.testing import tiny_model as tiny


def test_filters_hand_computed():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    torch.testing.assert_close(apply_sampling_filters(logits, 1.0), torch.softmax(logits, -1))
    # top_k=2 keeps {0.5, 0.2} -> renormalised
    torch.testing.assert_close(apply_sampling_filters(logits, 1.0, top_k=2),
                               torch.tensor([5 / 7, 2 / 7, 0, 0, 0]))
    # top_p=0.8: 0.5 (<0.8), 0.5+0.2=0.7 (<0.8), +0.15=0.85 reaches it -> keep three
    torch.testing.assert_close(apply_sampling_filters(logits, 1.0, top_p=0.8),
                               torch.tensor([0.5, 0.2, 0.15, 0, 0]) / 0.85)
    # temperature 2 flattens: p_i proportional to sqrt(p_i)
    p = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]).sqrt()
    torch.testing.assert_close(apply_sampling_filters(logits, 2.0), p / p.sum())
    # temperature 0 is the greedy one-hot
    assert apply_sampling_filters(logits, 0.0).tolist() == [1, 0, 0, 0, 0]


def test_sample_token_frequencies_chi_square():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    g = torch.Generator().manual_seed(1234)
    n = 4000
    counts = torch.bincount(torch.tensor([sample_token(logits, 1.0, generator=g)
                                          for _ in range(n)]), minlength=4)
    p = stats.chisquare(counts.numpy(), [0.4 * n, 0.3 * n, 0.2 * n, 0.1 * n]).pvalue
    assert p > 0.001, counts
    # a wrong distribution is rejected by the same test (the test can fail)
    assert stats.chisquare(counts.numpy(), [0.25 * n] * 4).pvalue < 1e-6


def test_generate_greedy_equals_no_cache_argmax_loop():
    model = tiny()
    prompt = [3, 9, 27, 81, 115]
    out = generate(model, prompt, 12, ignore_eos=True)
    ids = list(prompt)
    for _ in range(12):  # independent reference: full recompute every step, no cache
        with torch.no_grad():
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert out == ids[len(prompt):]


def test_generate_seeded_sampling_is_reproducible_and_seed_sensitive():
    model = tiny()
    a = generate(model, [1, 2, 3], 20, temperature=1.0, seed=7, ignore_eos=True)
    b = generate(model, [1, 2, 3], 20, temperature=1.0, seed=7, ignore_eos=True)
    c = generate(model, [1, 2, 3], 20, temperature=1.0, seed=8, ignore_eos=True)
    assert a == b and a != c


def test_generate_stops_on_eos_and_stop_tokens():
    model = tiny()
    kw = dict(temperature=1.0, seed=3)
    free = generate(model, [4, 5, 6], 10, ignore_eos=True, **kw)
    k = next(i for i in range(2, 10) if free[i] not in free[:i])  # first fresh token after 2
    eos_model = tiny(eos_token_id=free[k])
    assert generate(eos_model, [4, 5, 6], 10, **kw) == free[:k + 1]
    assert generate(eos_model, [4, 5, 6], 10, ignore_eos=True, **kw) == free
    assert generate(model, [4, 5, 6], 10, stop_token_ids=[free[k]], **kw) == free[:k + 1]


def test_generate_stops_at_context_end():
    model = tiny()
    out = generate(model, [i % 128 for i in range(250)], 50, ignore_eos=True)
    assert len(out) == 6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_close_to_fp32(dtype):
    model = tiny()
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(0))
    ref = model(ids)
    low = tiny().to(dtype)(ids).float()
    assert (low - ref).abs().max() < 0.05


def test_generate_bad_input():
    model = tiny()
    with pytest.raises(ValueError, match="empty"):
        generate(model, [], 5)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(model, [1], 0)
    with pytest.raises(ValueError, match="temperature"):
        generate(model, [1], 5, temperature=-0.5)
    with pytest.raises(ValueError, match="top_p"):
        generate(model, [1], 5, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match="token ids"):
        generate(model, [1, 500], 5)
    with pytest.raises(ValueError, match="context"):
        generate(model, [1] * 256, 5)


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": float("nan")}, "finite"),
    ({"temperature": float("inf")}, "finite"),
    ({"temperature": "0.7"}, "temperature must be a number"),
    ({"temperature": 1.0, "top_p": float("nan")}, "finite"),
    ({"temperature": 1.0, "top_k": 2.5}, "whole number"),
    ({"temperature": True}, "temperature must be a number"),
])
def test_generate_rejects_non_numbers(kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(tiny(), [1], 3, **kwargs)


def test_generate_prompt_ids_must_be_integers():
    import numpy as np

    model = tiny()
    ref = generate(model, [1, 2, 3], 4)
    assert generate(model, list(np.array([1, 2, 3])), 4) == ref  # numpy ints are ids
    assert generate(model, list(torch.tensor([1, 2, 3])), 4) == ref  # so are 0-d tensors
    for bad in ([1.7, 2], ["1"], [True, 2]):
        with pytest.raises(ValueError, match="integer token ids"):
            generate(model, bad, 3)

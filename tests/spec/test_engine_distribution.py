"""Through labkit.LLM at temperature 1, the first speculated token follows the target exactly.

Each of N seeded requests samples token 0 by plain sampling (prefill) and token 1 in the first
verify step (drafts proposed, accepted or rejected, corrected or bonus). Token 1's marginal must
be  m(y) = sum_x p(x | prompt) p(y | prompt, x), which we compute exactly with the target's plain
forward over all V continuations, and compare with a chi-square test at significance 0.001
(cells with expected count < 5 merged). Seeds are fixed, so the test is deterministic. A negative
control patches the verifier to accept every draft and must fail the same test.
"""

from __future__ import annotations

import copy

import pytest
import torch
from scipy.stats import chisquare

from labkit import LLM, SamplingParams
from labkit.engine.invariants import assert_no_leaks
from labkit.spec import executor as spec_executor

N = 3000
SIGNIFICANCE = 1e-3
SHORT = [1, 5, 9, 5, 9, 5, 9, 17, 3]
LONG = SHORT + list(range(128))  # every token has an earlier occurrence: n-gram always drafts


def _sharpen(model, scale: float = 20.0):
    """Random tiny models are nearly uniform over 128 tokens; a sharper head gives a few dozen
    likely tokens, so N samples fill the chi-square cells."""
    m = copy.deepcopy(model)
    with torch.no_grad():
        m.lm_head.weight.mul_(scale)
    return m


@pytest.fixture(scope="module")
def sharp(target, drafts):
    return {"target": _sharpen(target), "small": _sharpen(drafts["small"]),
            "noisy": _sharpen(drafts["noisy"])}


@torch.inference_mode()
def _second_token_marginal(model, prompt):
    p0 = torch.softmax(model(torch.tensor([prompt]))[0, -1].double(), -1)
    v = p0.numel()
    x = torch.tensor([prompt + [i] for i in range(v)])
    p1 = torch.softmax(model(x)[:, -1].double(), -1)
    return (p0[:, None] * p1).sum(0)


def _pvalue(tokens: list[int], probs: torch.Tensor) -> float:
    counts = torch.bincount(torch.tensor(tokens), minlength=probs.numel()).double()
    expected = probs * len(tokens)
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    exp = exp * obs.sum() / exp.sum()
    return float(chisquare(obs.numpy(), exp.numpy()).pvalue)


def _run(target, config, prompt, both_branches=True):
    llm = LLM(target, block_size=16, max_num_seqs=512, speculative_config=config)
    sp = [SamplingParams(temperature=1.0, max_tokens=4, seed=s, ignore_eos=True)
          for s in range(N)]
    outs = llm.generate(prompt_token_ids=[prompt] * N, sampling_params=sp)
    steps = llm.llm_engine.trace.to_dict()["steps"]
    first = {}
    for st in steps:
        for r in st["spec"]:
            first.setdefault(r["seq_id"], r)
    assert len(first) == N and all(len(r["proposed"]) == 2 for r in first.values())
    accepted = sum(r["accepted"] > 0 for r in first.values())
    if both_branches:  # accept and reject both happened
        assert 0 < accepted < N
    assert_no_leaks(llm.llm_engine)
    return [o.outputs[0].token_ids[1] for o in outs]


CASES = {
    "draft_small": ("small", SHORT),
    "draft_noisy": ("noisy", SHORT),
    "ngram": (None, LONG),
}


@pytest.mark.parametrize("case", list(CASES))
def test_first_speculated_token_matches_target(sharp, case):
    draft, prompt = CASES[case]
    config = ({"method": "ngram", "num_speculative_tokens": 2} if draft is None else
              {"method": "draft_model", "model": sharp[draft], "num_speculative_tokens": 2})
    tokens = _run(sharp["target"], config, prompt)
    assert _pvalue(tokens, _second_token_marginal(sharp["target"], prompt)) > SIGNIFICANCE


def test_negative_control_always_accept_is_detected(sharp, monkeypatch):
    def always_accept(drafts, q, logits, temperature, top_k, top_p, generator):
        from labkit.model.sampling import sample_token

        bonus = sample_token(logits[len(drafts)], temperature, top_k, top_p, generator)
        return list(drafts) + [bonus], len(drafts)

    monkeypatch.setattr(spec_executor, "verify", always_accept)
    config = {"method": "draft_model", "model": sharp["small"], "num_speculative_tokens": 2}
    tokens = _run(sharp["target"], config, SHORT, both_branches=False)
    assert _pvalue(tokens, _second_token_marginal(sharp["target"], SHORT)) < 1e-6

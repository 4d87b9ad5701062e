"""LeanDraft (the draft's fused forward) computes the model's logits; the engine drafts with it
and greedy speculative output stays the plain output token for token.

References: the draft module's own uncached forward over the whole context, and plain decoding
through the engine."""

from __future__ import annotations

import pytest
import torch

from labkit.engine.model_runner import ModelRunner
from labkit.kv.attention import get_attention_backend
from labkit.model.generate import ContiguousKVCache
from labkit.spec.lean_draft import LeanDraft, lean_draft
from labkit.spec.proposers import DraftModelProposer


@pytest.mark.parametrize("overrides", [{}, {"tie_word_embeddings": True},
                                       {"num_key_value_heads": 4}])
def test_logits_equal_the_module_prefill_then_decode(build_model, overrides):
    model = build_model(3, **overrides)
    lean = LeanDraft(model)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator()
                        .manual_seed(0))
    ref = model(ids)  # no cache: plain causal attention over the whole context
    cache = ContiguousKVCache(model, 2, 12)
    got = [lean(ids[:, :9], None, cache)]
    for t in range(9, 12):  # one token at a time after the prompt
        got.append(lean(ids[:, t:t + 1], torch.full((2, 1), t), cache))
    torch.testing.assert_close(torch.cat(got, 1), ref, atol=1e-5, rtol=1e-4)


def test_paged_packed_rows_equal_the_module(build_model):
    """Two sequences packed in one row, through the paged cache: the engine's draft path."""
    model = build_model(4)
    be = get_attention_backend("torch")
    runners = [ModelRunner.for_model(m, 4, 16, 0, be) for m in (model, LeanDraft(model))]
    a, b = list(range(3, 13)), list(range(40, 47))
    outs = []
    for r in runners:
        r.forward([([0, 1, 2], 0, a[:-2]), ([5, 6], 0, b[:-1])], [[7], [5]])
        outs.append(r.forward([([0, 1, 2], 8, a[-2:]), ([5, 6], 6, b[-1:])], [[0, 1], [0]]))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-4)
    ref = torch.stack([model(torch.tensor([a]))[0, -2], model(torch.tensor([a]))[0, -1],
                       model(torch.tensor([b]))[0, -1]])
    torch.testing.assert_close(outs[1], ref, atol=1e-5, rtol=1e-4)


def test_uncovered_models_keep_the_module_forward(build_model):
    """Biases (Qwen2-style) or a sliding window (every layer, or some per ``layer_types``): no
    LeanDraft, the proposer runs the module."""
    per_layer = {"sliding_window": 6, "layer_types": ["full_attention", "sliding_attention"]}
    for kw in ({"attention_bias": True}, {"sliding_window": 6}, per_layer):
        model = build_model(5, **kw)
        assert lean_draft(model) is None
        with pytest.raises(ValueError, match="plain LlamaForCausalLM"):
            LeanDraft(model)
        assert DraftModelProposer(model, 2, 8, 4).runner.model is model
    assert isinstance(DraftModelProposer(build_model(5), 2, 8, 4).runner.model, LeanDraft)


def test_shipped_draft_keeps_greedy_output_through_the_lean_path():
    """The default draft (labkit-tiny-draft-distilled) drafts through LeanDraft in the engine;
    greedy output equals plain decoding and it accepts a good share of its drafts."""
    from labkit import LLM
    from labkit.bench.common import greedy_params
    from labkit.bench.spec import DEFAULT_DRAFT
    from labkit.model.loader import load_pretrained
    from labkit.sim.workloads import prompt_texts

    target, tok = load_pretrained("labkit-tiny")
    draft, _ = load_pretrained(DEFAULT_DRAFT)
    prompts = [tok.encode(t) for t in prompt_texts("code_prompts")[:2]]
    params = greedy_params(32)
    plain = LLM(target).generate(prompt_token_ids=prompts, sampling_params=params)
    llm = LLM(target, speculative_config={"method": "draft_model", "model": draft,
                                          "num_speculative_tokens": 2})
    spec = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    ex = llm.llm_engine.executor
    assert isinstance(ex.proposer.runner.model, LeanDraft)
    assert ex.num_accepted_tokens > 0.4 * ex.num_draft_tokens > 0

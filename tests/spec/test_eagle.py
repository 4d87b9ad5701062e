"""The EAGLE head: its drafts inside the engine equal an uncached reference built from whole-
sequence forwards, greedy output stays the target's, training raises agreement, save/load."""

from __future__ import annotations

import copy

import pytest
import torch

from labkit import LLM, SamplingParams
from labkit.engine.invariants import assert_no_leaks
from labkit.model.generate import generate
from labkit.spec import SpeculativeConfigError
from labkit.spec.eagle import (
    EagleDraft,
    EagleTrainConfig,
    load_eagle,
    save_eagle,
    target_features,
    train_eagle,
)
from labkit.spec.lean_draft import LeanEagle, lean_draft

PROMPTS = [[1, 5, 9, 5, 9, 5, 9, 17, 3], list(range(10, 40)), [7] * 5 + [8, 9], [3, 3, 4]]


@pytest.fixture(scope="module")
def head(target):
    torch.manual_seed(1)
    h = EagleDraft(target)
    with torch.no_grad():
        for p in h.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return h.eval()


def _greedy(n):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@torch.no_grad()
def reference_drafts(target, head, context: list[int], gamma: int) -> list[int]:
    """EAGLE drafting without any cache: the target's features of the whole context, then the
    head over the whole (token, previous feature) sequence once per draft token."""
    ids = torch.tensor([context])
    _, f = target_features(target, ids)
    feats = torch.cat([torch.zeros_like(f[:, :1]), f[:, :-1]], dim=1)  # f_{p-1} at p
    out = []
    for _ in range(gamma):
        pos = torch.arange(ids.shape[1])[None]
        h = head.hidden(ids, feats, pos)
        tok = int(head.logits(h[:, -1]).argmax())
        out.append(tok)
        ids = torch.cat([ids, torch.tensor([[tok]])], dim=1)
        feats = torch.cat([feats, h[:, -1:]], dim=1)
    return out


@pytest.mark.parametrize("gamma", [1, 3])
def test_engine_drafts_equal_uncached_reference(target, head, gamma):
    prompt = PROMPTS[0]
    llm = LLM(target, block_size=4, speculative_config={
        "method": "eagle", "model": head, "num_speculative_tokens": gamma})
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=_greedy(24))[0]
    tokens = out.outputs[0].token_ids
    trace = llm.llm_engine.trace.to_dict()
    ctx, checked = list(prompt), 0
    for step in trace["steps"]:
        for rec in step["spec"]:
            assert rec["proposed"] == reference_drafts(target, head, ctx, len(rec["proposed"]))
            checked += 1
        ctx += next(iter(step["outputs"].values()), [])  # one sequence
    assert checked > 3
    assert ctx == prompt + tokens
    assert isinstance(llm.llm_engine.executor.proposer.runner.model, LeanEagle)  # fused path


def test_lean_eagle_equals_the_module(target, head):
    """LeanEagle (fused q|k|v and gate|up, norms folded): the module's logits and predicted
    features, prefill then one token at a time through a KV cache."""
    from labkit.model.generate import ContiguousKVCache

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, target.config.vocab_size, (2, 10), generator=gen)
    feats = torch.randn(2, 10, target.config.hidden_size, generator=gen)
    pos = torch.arange(10).expand(2, 10)
    with torch.no_grad():
        want_h = head.hidden(ids, feats, pos)  # uncached, whole sequence
        want = head.logits(want_h)
    lean, cache = lean_draft(head), ContiguousKVCache(head, 2, 10)
    assert isinstance(lean, LeanEagle)
    got, hid = [lean(ids[:, :7], None, cache, features=feats[:, :7])], [lean.last_hidden]
    for t in range(7, 10):
        got.append(lean(ids[:, t:t + 1], pos[:, t:t + 1], cache, features=feats[:, t:t + 1]))
        hid.append(lean.last_hidden)
    torch.testing.assert_close(torch.cat(got, 1), want, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat(hid, 1), want_h, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="features"):
        lean(ids, None, ContiguousKVCache(head, 2, 10))


@pytest.mark.parametrize("gamma", [2, 4])
def test_greedy_equals_reference_with_preemption(target, head, gamma):
    want = [generate(target, p, 30, ignore_eos=True) for p in PROMPTS]
    llm = LLM(target, block_size=4, num_blocks=20, speculative_config={
        "method": "eagle", "model": head, "num_speculative_tokens": gamma})
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=_greedy(30))
    assert [o.outputs[0].token_ids for o in outs] == want
    assert llm.llm_engine.stats()["num_preemptions"] > 0
    assert llm.llm_engine.executor.num_accepted_tokens > 0
    assert_no_leaks(llm.llm_engine)


def test_eagle_needs_a_head():
    with pytest.raises(SpeculativeConfigError, match="needs \"model\""):
        LLM("labkit-tiny", speculative_config={"method": "eagle"})


def test_training_raises_agreement_and_save_load_roundtrips(target, tmp_path):
    # the random tiny model's logits are nearly flat (its argmax is noise); sharpen them
    target = copy.deepcopy(target)
    with torch.no_grad():
        target.lm_head.weight.mul_(30)  # tied: the embedding too
    gen = torch.Generator().manual_seed(0)
    stream = torch.randint(0, target.config.vocab_size, (4000,), generator=gen)
    # the target's own greedy text, as the head is trained on in practice
    text = torch.cat([generate_ids(target, stream[i:i + 4].tolist(), 29) for i in range(0, 32, 4)])
    probe = [text[i:i + 1] for i in range(4)]  # can it fit the target's own text at all
    torch.manual_seed(0)
    draft = EagleDraft(target)
    cfg = EagleTrainConfig(steps=60, batch_size=8, seq_len=32, lr=3e-3, eval_every=60,
                           noise=0.0, text_fraction=1.0)
    log = train_eagle(target, draft, cfg, stream, text, probe=probe, progress=False)
    first, last = log["eval"][0]["top1_agreement"], log["eval"][-1]["top1_agreement"]
    assert last > first + 0.3
    save_eagle(draft, tmp_path / "head", "tiny")
    back = load_eagle(tmp_path / "head", target)
    x = torch.tensor([[1, 2, 3, 4]])
    f = torch.randn(1, 4, target.config.hidden_size)
    assert torch.allclose(back.hidden(x, f, torch.arange(4)[None]),
                          draft.hidden(x, f, torch.arange(4)[None]).half().float(), atol=2e-2)
    with pytest.raises(ValueError, match="not an EAGLE head"):
        load_eagle(tmp_path, target)


def generate_ids(target, prompt, n):
    return torch.tensor([prompt + generate(target, prompt, n, ignore_eos=True)])


def test_shipped_head_is_float16_and_keeps_greedy_output():
    from safetensors import safe_open

    from labkit.model.loader import load_pretrained, models_dir

    d = models_dir() / "labkit-tiny-eagle"
    if not (d / "model.safetensors").is_file():
        pytest.skip("labkit-tiny-eagle is not in datasets/models")
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float16}
        assert not any(k.startswith(("embed", "lm_head", "norm")) for k in f.keys())
    assert "labkit distill --eagle" in (d / "README.md").read_text()
    target, tok = load_pretrained("labkit-tiny")
    prompt = tok.encode("def gcd(a, b):\n")
    llm = LLM(target, speculative_config={"method": "eagle", "model": "labkit-tiny-eagle",
                                          "num_speculative_tokens": 3})
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=_greedy(24))[0]
    assert out.outputs[0].token_ids == generate(target, prompt, 24, ignore_eos=True)
    assert llm.llm_engine.executor.num_accepted_tokens > 0


def test_sampled_drafts_carry_their_distribution_and_runs_repeat(target, head, monkeypatch):
    """Temperature sampling goes through the same rejection rule as a draft model: each draft
    comes with the filtered q it was drawn from, and a seeded run is reproducible."""
    from labkit.spec.eagle_proposer import EagleProposer

    seen = []
    orig = EagleProposer.propose

    def spy(self, requests):
        props = orig(self, requests)
        seen.extend(p for p in props if p.token_ids)
        return props

    monkeypatch.setattr(EagleProposer, "propose", spy)
    params = SamplingParams(temperature=0.8, top_k=20, max_tokens=16, ignore_eos=True, seed=7)
    runs = []
    for _ in range(2):
        llm = LLM(target, block_size=4, speculative_config={
            "method": "eagle", "model": head, "num_speculative_tokens": 3})
        runs.append([o.outputs[0].token_ids for o in llm.generate(
            prompt_token_ids=PROMPTS[:2], sampling_params=params)])
        assert_no_leaks(llm.llm_engine)
    assert runs[0] == runs[1] and all(len(t) == 16 for t in runs[0])
    assert seen and all(p.probs is not None and p.probs.shape[0] == len(p.token_ids)
                        and torch.allclose(p.probs.sum(-1), torch.ones(len(p.token_ids)))
                        for p in seen)


def test_head_on_a_per_layer_window_target_takes_its_last_layers_kind():
    """A target whose layers differ (layer_types): the head's one layer is of the kind of the
    target's last layer, whose features it continues from."""
    from labkit.model.testing import tiny_model

    for last, window in (("sliding_attention", 4), ("full_attention", None)):
        target = tiny_model(0, sliding_window=4, layer_types=["sliding_attention", last])
        head = EagleDraft(target)
        assert head.layer.self_attn.sliding_window == window

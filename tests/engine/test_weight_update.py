"""LLMEngine.update_weights: a hot swap between steps, no request lost, the prefix cache keyed
by weight version (never stale KV), bad input refused with the old weights left serving.

The references are labkit.model.generate on a model that only ever held one set of weights
(the "fresh engine loaded with the new weights")."""

from __future__ import annotations

import copy

import pytest
import torch

from labkit.engine.invariants import assert_no_leaks
from labkit.engine.llm_engine import LLMEngine
from labkit.engine.sampling_params import SamplingParams
from labkit.errors import WeightUpdateError
from labkit.model import testing
from labkit.model.generate import generate

N = 6
SP = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
PROMPT = [(7 * i + 3) % 128 for i in range(13)]  # 3 full blocks of 4, plus one token


@pytest.fixture(scope="module")
def old_new():
    return testing.tiny_model(seed=0), testing.tiny_model(seed=1)


def _engine(model, **kw):
    return LLMEngine.from_model(copy.deepcopy(model), None, block_size=4, num_blocks=64, **kw)


def _run(eng, rid, prompt, sp=SP):
    eng.add_request(rid, prompt, sp)
    out = []
    while eng.has_unfinished_requests():
        out += [t for o in eng.step() if o.request_id == rid for t in o.new_token_ids]
    return out


def test_versioned_prefix_cache_never_serves_stale_kv(old_new):
    old, new = old_new
    eng = _engine(old)
    assert _run(eng, "a", PROMPT) == generate(old, PROMPT, N)  # caches PROMPT's 3 blocks
    info = eng.update_weights(new.state_dict(), version="v2")
    assert info == {"version": "v2", "previous_version": None, "num_recomputed": 0}
    assert _run(eng, "b", PROMPT) == generate(new, PROMPT, N)
    assert eng.requests["b"].seqs[0].num_cached_tokens == 0  # the old blocks never matched
    assert _run(eng, "c", PROMPT) == generate(new, PROMPT, N)  # new-version blocks do
    assert eng.requests["c"].seqs[0].num_cached_tokens == 12
    assert eng.stats()["weight_version"] == "v2"
    assert_no_leaks(eng)


def test_unversioned_key_serves_stale_kv(old_new):
    """The negative control: without the version in the key the cached prefix's old KV is
    read by the new weights, and the output is neither model's."""
    old, new = old_new
    eng = _engine(old)
    _run(eng, "a", PROMPT)
    eng.update_weights(new.state_dict(), version="v2", key_by_version=False)
    stale = _run(eng, "b", PROMPT)
    assert eng.requests["b"].seqs[0].num_cached_tokens == 12
    assert stale != generate(new, PROMPT, N)


def test_requests_in_flight_are_recomputed_and_none_is_lost(old_new):
    old, new = old_new
    eng = _engine(old, max_num_seqs=4)
    prompts = [PROMPT, PROMPT[:5], [9] * 9, [1, 2, 3]]
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, SP)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(4)}
    for _ in range(3):
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    at_swap = {r: list(t) for r, t in got.items()}
    assert any(at_swap.values()) and all(len(t) < N for t in at_swap.values())
    running = len(eng.scheduler.running)
    info = eng.update_weights(new.state_dict(), version="v2")
    assert info["num_recomputed"] == running > 0 and not eng.scheduler.running
    while eng.has_unfinished_requests():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
    for i, p in enumerate(prompts):
        rid, k = f"r{i}", len(at_swap[f"r{i}"])
        assert eng.requests[rid].seqs[0].finish_reason == "length"
        assert got[rid][:k] == generate(old, p, k)  # before the swap: the old weights
        assert got[rid][k:] == generate(new, p + got[rid][:k], N - k)  # after: the new ones
    assert_no_leaks(eng)


def _bad_states(model):
    sd = {k: v.clone() for k, v in model.state_dict().items()}
    missing = dict(sd)
    missing.pop("model.layers.0.mlp.up_proj.weight")
    shape = dict(sd)
    shape["model.norm.weight"] = torch.ones(65)
    extra = {**sd, "model.layers.9.mlp.up_proj.weight": torch.ones(1)}
    return {"missing": (missing, "missing 1"), "shape": (shape, "has shape"),
            "unexpected": (extra, "unexpected 1"),
            "not a tensor": ({**sd, "model.norm.weight": [1.0]}, "not a tensor")}


@pytest.mark.parametrize("case", ["missing", "shape", "unexpected", "not a tensor"])
def test_bad_weights_are_refused_and_old_weights_keep_serving(old_new, case):
    old, new = old_new
    eng = _engine(old)
    state, msg = _bad_states(new)[case]
    with pytest.raises(WeightUpdateError, match=msg):
        eng.update_weights(state, version="v2")
    assert eng.stats()["weight_version"] is None
    assert _run(eng, "a", PROMPT) == generate(old, PROMPT, N)


def test_bad_version_and_folder_are_refused(old_new, tmp_path):
    old, new = old_new
    eng = _engine(old)
    with pytest.raises(WeightUpdateError, match="non-empty string"):
        eng.update_weights(new.state_dict(), version="")
    with pytest.raises(WeightUpdateError, match="cannot read new weights"):
        eng.update_weights(tmp_path / "nowhere", version="v2")
    eng.update_weights(new.state_dict(), version="v2")
    with pytest.raises(WeightUpdateError, match="already used"):
        eng.update_weights(old.state_dict(), version="v2")
    assert _run(eng, "a", PROMPT) == generate(new, PROMPT, N)


def test_update_from_a_hugging_face_folder(tmp_path):
    """A folder written by transformers' save_pretrained; the reference is a fresh model loaded
    from that folder."""
    pytest.importorskip("transformers")
    from labkit.model.loader import load_model

    for seed, name in ((0, "old"), (1, "new")):
        testing.tiny_llama_checkpoint(tmp_path / name, seed)
    old, new = load_model(tmp_path / "old"), load_model(tmp_path / "new")
    eng = _engine(old)
    _run(eng, "a", PROMPT)
    eng.update_weights(str(tmp_path / "new"), version="step-2")
    assert _run(eng, "b", PROMPT) == generate(new, PROMPT, N)
    testing.tiny_llama_checkpoint(tmp_path / "wide", 2, hidden_size=32)
    with pytest.raises(WeightUpdateError, match="has shape"):
        eng.update_weights(str(tmp_path / "wide"), version="step-3")
    assert _run(eng, "c", PROMPT) == generate(new, PROMPT, N)

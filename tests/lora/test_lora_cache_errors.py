"""The prefix cache keeps adapters apart, the adapter LRU levels, and every named LoRA error."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import labkit
from labkit import LoRAError, LoRARequest
from labkit.errors import EngineConfigError, InvalidPromptError
from labkit.kv.prefix import hash_prompt_blocks
from labkit.model.fuse import fuse_projections
from labkit.model.loader import load_model

from .conftest import peft_greedy, save_adapter, save_base
from .test_lora_engine import greedy, make_llm, tokens

LONG = [7, 3, 19, 44, 2, 8, 61, 5, 12, 90, 33, 4, 27]  # 3 full blocks of 4 may be cached


def test_prefix_keys_include_the_adapter():
    toks = list(range(8))
    none, one, two = (hash_prompt_blocks(toks, 4, lora_int_id=i) for i in (None, 1, 2))
    assert none == hash_prompt_blocks(toks, 4)  # base keys unchanged
    assert len({*none, *one, *two}) == 6  # no block key shared between the three
    assert one == hash_prompt_blocks(toks, 4, lora_int_id=1)


def test_prefix_cache_shared_within_an_adapter_never_across(llama_dir, llama_adapters):
    a = LoRARequest("attn", 1, str(llama_adapters["attn"]))
    b = LoRARequest("mlp", 2, str(llama_adapters["mlp"]))
    llm = make_llm(llama_dir)

    def run(lora):
        out = llm.generate(prompt_token_ids=[LONG], sampling_params=greedy(), lora_request=lora)[0]
        return out.outputs[0].token_ids, out.num_cached_tokens

    first_a, hit = run(a)
    assert hit == 0
    again_a, hit = run(a)
    assert hit == 12 and again_a == first_a  # same adapter: three blocks reused
    got_b, hit = run(b)
    assert hit == 0  # another adapter: no block of a's
    base, hit = run(None)
    assert hit == 0  # the base model: none either
    assert run(None)[1] == 12 and run(b)[1] == 12
    assert again_a == peft_greedy(llama_dir, a.lora_path, LONG, 10)
    assert got_b == peft_greedy(llama_dir, b.lora_path, LONG, 10)
    assert base == peft_greedy(llama_dir, None, LONG, 10)


def test_lru_levels(llama_dir, llama_adapters, tmp_path):
    """max_loras=2 slots, max_cpu_loras=3 cached; the expected orders are worked out by hand
    in the comments (oldest first)."""
    paths = [*llama_adapters.values(),
             save_adapter(llama_dir, tmp_path / "d", ["v_proj"], r=2, alpha=4, seed=9)]
    reqs = {i: LoRARequest(f"a{i}", i, str(p)) for i, p in enumerate(paths, 1)}
    llm = make_llm(llama_dir, max_loras=2, max_cpu_loras=3)
    mgr = llm.llm_engine.executor.manager
    for i in (1, 2, 3, 4, 2):  # 4 evicts 1 from the CPU cache; 2 is touched, not reloaded
        mgr.add_lora(reqs[i])
    assert list(mgr.cpu_cache) == [3, 4, 2]
    assert (mgr.counts["disk_loads"], mgr.counts["cpu_evictions"]) == (4, 1)
    for ids in ({3}, {4}, {3}):  # slots: [3], [3, 4], then 3 used again: [4, 3]
        mgr.activate(ids)
    assert list(mgr.slot_lru) == [4, 3]
    mgr.activate({2})  # 4 is the least recently used: evicted
    assert list(mgr.slot_lru) == [3, 2] and mgr.counts["slot_evictions"] == 1
    mgr.activate({1, 3})  # 2 evicted (3 is in the step); 1 is re-read from disk
    assert list(mgr.slot_lru) == [1, 3]
    assert mgr.counts == {"disk_loads": 5, "cpu_evictions": 2, "slot_loads": 4,
                          "slot_evictions": 2}
    with pytest.raises(RuntimeError):
        mgr.activate({1, 2, 3})
    # the slot holds adapter 1's weights as peft saved them
    saved = load_file(str(paths[0] / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"
    layer = mgr.layers["model.layers.1.self_attn.k_proj"]
    assert torch.equal(layer.lora_a[mgr.slot_of(1), :8], saved[key])


def _edit_config(path, **changes):
    f = path / "adapter_config.json"
    cfg = json.loads(f.read_text())
    cfg.update(changes)
    f.write_text(json.dumps(cfg))


def test_named_errors_for_bad_adapters(llama_dir, llama_adapters, tmp_path):
    llm = make_llm(llama_dir, max_lora_rank=8)
    eng = llm.llm_engine

    def add(path, lid=1):
        with pytest.raises(LoRAError) as e:
            llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=greedy(),
                         lora_request=LoRARequest("x", lid, str(path)))
        assert not eng.has_unfinished_requests()
        return str(e.value)

    assert "exceeds max_lora_rank=8" in add(llama_adapters["all"])  # r=16
    lacks = save_adapter(llama_dir, tmp_path / "lacks", ["q_proj"], seed=1)
    _edit_config(lacks, target_modules=["q_proj", "c_attn"])
    assert "c_attn" in add(lacks)
    deeper = save_base(tmp_path / "deep", num_hidden_layers=3)
    assert "layers.2" in add(save_adapter(deeper, tmp_path / "deep-a", ["q_proj"], seed=1))
    wider = save_base(tmp_path / "wide", intermediate_size=96)
    assert "another model" in add(save_adapter(wider, tmp_path / "wide-a", ["up_proj"], seed=1))
    dora = save_adapter(llama_dir, tmp_path / "dora", ["q_proj"], seed=1, use_dora=True)
    assert "use_dora" in add(dora)
    assert "not a PEFT adapter folder" in add(tmp_path)
    llm.generate(prompt_token_ids=[[1, 2, 3]], sampling_params=greedy(),
                 lora_request=LoRARequest("ok", 5, str(llama_adapters["attn"])))
    assert "one id, one adapter" in add(llama_adapters["mlp"], lid=5)


def test_named_errors_for_bad_requests_and_settings(llama_dir, llama_adapters):
    a = LoRARequest("attn", 1, str(llama_adapters["attn"]))
    plain = labkit.LLM(model=(load_model(llama_dir), None), block_size=4)
    with pytest.raises(LoRAError, match="enable_lora=True"):
        plain.generate(prompt_token_ids=[[1, 2]], sampling_params=greedy(), lora_request=a)
    with pytest.raises(LoRAError, match="lora_int_id"):
        LoRARequest("x", 0, "p")
    llm = make_llm(llama_dir)
    with pytest.raises(InvalidPromptError, match="2 lora requests for 1 prompts"):
        llm.generate(prompt_token_ids=[[1, 2]], sampling_params=greedy(), lora_request=[a, a])
    with pytest.raises(LoRAError, match="LoRARequest"):
        llm.generate(prompt_token_ids=[[1, 2]], sampling_params=greedy(), lora_request="attn")
    with pytest.raises(EngineConfigError, match="enable_lora=True"):
        labkit.LLM(model=(load_model(llama_dir), None), max_loras=2)
    with pytest.raises(EngineConfigError, match="max_cpu_loras"):
        make_llm(llama_dir, max_loras=3, max_cpu_loras=2)
    with pytest.raises(EngineConfigError, match="tensor parallelism"):
        make_llm(llama_dir, distributed_executor_backend="mp")
    with pytest.raises(LoRAError, match="already has LoRA layers"):
        labkit.LLM(model=(llm.model, None), enable_lora=True, block_size=4)


def test_fused_projections_take_adapters_per_slice(llama_dir, llama_adapters):
    """q|k|v and gate|up fused into one matmul each: every slice still gets its own delta."""
    fused = load_model(llama_dir)
    assert fuse_projections(fused) == 4
    llm = labkit.LLM(model=(fused, None), block_size=4, enable_lora=True, max_loras=3,
                     max_lora_rank=16)
    reqs = [LoRARequest(n, i, str(p)) for i, (n, p) in enumerate(llama_adapters.items(), 1)]
    prompt = [5, 17, 42, 8, 3]
    got = tokens(llm.generate(prompt_token_ids=[prompt] * 4, sampling_params=greedy(),
                              lora_request=[None, *reqs]))
    assert got == [peft_greedy(llama_dir, None if r is None else r.lora_path, prompt, 10)
                   for r in [None, *reqs]]


def test_base_requests_unchanged_by_enable_lora(llama_dir):
    prompts = [[5, 17, 42], [9, 9, 1, 2]]
    plain = labkit.LLM(model=(load_model(llama_dir), None), block_size=4)
    lora = make_llm(llama_dir)
    assert tokens(lora.generate(prompt_token_ids=prompts, sampling_params=greedy())) == \
        tokens(plain.generate(prompt_token_ids=prompts, sampling_params=greedy()))

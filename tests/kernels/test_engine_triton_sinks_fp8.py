"""The engine on the Triton kernels (interpreter on CPU) with what they used to refuse: gpt-oss's
attention sinks (a tiny random checkpoint written by transformers, sliding and full layers) and
an FP8 (e4m3) KV cache, apart and together. Greedy tokens must equal the torch backend's,
through chunked prefill and a prefix-cache hit, and the kernels must really have served the run."""

import pytest
import torch
from labkit.kernels.backend import TritonBackend

from labkit.engine.invariants import assert_no_leaks
from labkit.engine.llm import LLM
from labkit.engine.sampling_params import SamplingParams
from labkit.model.testing import tiny_model

MAX_NEW = 5
ENGINE = dict(block_size=4, num_blocks=64, max_num_batched_tokens=16,
              enable_prefix_caching=True)


@pytest.fixture
def calls(monkeypatch):
    """Count the TritonBackend's decode/prefill calls, and the ones that carried sinks."""
    seen = {"decode": 0, "prefill": 0, "sinks": 0}
    for name in ("decode", "prefill"):
        real = getattr(TritonBackend, name)

        def counted(self, *a, _real=real, _name=name, **kw):
            seen[_name] += 1
            seen["sinks"] += kw.get("sinks") is not None
            return _real(self, *a, **kw)

        monkeypatch.setattr(TritonBackend, name, counted)
    return seen


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(4)
    shared = torch.randint(2, vocab, (9,), generator=g).tolist()
    # the third prompt is scheduled after the first's blocks are cached (a prefix-cache hit);
    # the second, 19 tokens, is chunked (16-token budget)
    return [shared + [3, 4], torch.randint(2, vocab, (19,), generator=g).tolist(),
            shared + [5]]


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=params)
    assert_no_leaks(llm.llm_engine)
    assert llm.llm_engine.stats()["prefix_hit_tokens"] > 0
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def gpt_oss_checkpoint(tmp_path_factory):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GptOssConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
        num_experts_per_tok=2, sliding_window=6, max_position_embeddings=64,
        initializer_range=0.2, eos_token_id=None,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                         "original_max_position_embeddings": 32})
    torch.manual_seed(7)
    model = transformers.GptOssForCausalLM(cfg).eval()
    with torch.no_grad():  # sinks of both signs and sizes, so that they matter
        for name, t in model.named_parameters():
            if "sinks" in name:
                t.copy_(torch.randn_like(t) * 1.5)
    path = tmp_path_factory.mktemp("gpt_oss_triton")
    model.save_pretrained(path)
    return path


@pytest.mark.parametrize("kv", ["auto", "fp8"])  # sinks over a float and an e4m3 cache
def test_gpt_oss_sinks_triton_equals_torch(gpt_oss_checkpoint, calls, kv):
    prompts = _prompts(64)
    run = {be: _greedy(LLM(model=gpt_oss_checkpoint, dtype=torch.float32, device="cpu",
                           attention_backend=be, kv_cache_dtype=kv, **ENGINE), prompts)
           for be in ("torch", "triton")}
    assert run["triton"] == run["torch"]
    assert calls["decode"] > 0 and calls["prefill"] > 0
    assert calls["sinks"] == calls["decode"] + calls["prefill"]  # every layer's call had them


def test_fp8_kv_triton_equals_torch(calls):
    prompts = _prompts(128)
    run = {be: _greedy(LLM.from_model(tiny_model(), None, kv_cache_dtype="fp8",
                                      attention_backend=be, **ENGINE), prompts)
           for be in ("torch", "triton")}
    assert run["triton"] == run["torch"]
    assert calls["decode"] > 0 and calls["prefill"] > 0 and calls["sinks"] == 0

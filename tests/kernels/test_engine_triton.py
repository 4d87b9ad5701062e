"""The engine with attention_backend="triton" (kernels under the interpreter on CPU) generates
the same greedy tokens as the reference ``labkit.model.generate``, also with sliding windows
(every layer, Mistral; some layers, per ``layer_types``) shorter than the prompts."""

import pytest
import torch
from labkit.kernels.backend import TritonBackend

from labkit.engine.llm import LLM
from labkit.engine.sampling_params import SamplingParams
from labkit.model.generate import generate
from labkit.model.testing import tiny_model

WINDOWS = {
    "full": {},
    "mistral-window5": dict(sliding_window=5, architecture="MistralForCausalLM"),
    "per-layer-window5": dict(sliding_window=5, layer_types=["sliding_attention",
                                                             "full_attention"]),
}


@pytest.mark.parametrize("windows", list(WINDOWS))
def test_triton_backend_greedy_equals_reference(monkeypatch, windows):
    calls = {"decode": 0, "prefill": 0}
    for name in calls:
        real = getattr(TritonBackend, name)

        def counted(self, *a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(self, *a, **kw)

        monkeypatch.setattr(TritonBackend, name, counted)
    model = tiny_model(**WINDOWS[windows])
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 128, (16,), generator=g).tolist()
    prompts = [torch.randint(0, 128, (21,), generator=g).tolist(),  # chunked: 21 > 16 budget
               shared + [5, 9],                                      # prefix-cache hit later
               shared + [7],
               [3]]
    llm = LLM.from_model(model, attention_backend="triton", block_size=8, num_blocks=64,
                         max_num_batched_tokens=16)
    assert llm.llm_engine is not None
    outs = llm.generate(prompt_token_ids=prompts,
                        sampling_params=SamplingParams(max_tokens=6, temperature=0.0,
                                                       ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        want = generate(model, prompt, 6, ignore_eos=True)
        assert out.outputs[0].token_ids == want, prompt
    assert calls["decode"] > 0 and calls["prefill"] > 0  # the kernels really served the run
    assert llm.llm_engine.stats()["prefix_hit_tokens"] > 0  # the shared prefix was reused

"""The engine's LoRA deltas through the Triton kernels (``attention_backend="triton"``, run by
the interpreter on CPU): greedy output equals the PyTorch path and transformers + peft, for a
mixed batch whose steps hold prefill chunks (SGMV) and decode-only steps (BGMV)."""

from __future__ import annotations

from labkit import LoRARequest
from labkit.lora.punica import TorchPunica, TritonPunica, segments

from .conftest import peft_greedy
from .test_lora_engine import greedy, make_llm, tokens

PROMPTS = [[5, 17, 42, 8, 3], [33, 21, 90], [1, 2, 3, 4]]
N = 4


def test_segments_are_runs_of_one_slot():
    assert segments([1, 1, 1, -1, -1, 0]) == ([0, 3, 5, 6], [1, -1, 0])
    assert segments([]) == ([0], [])


def test_triton_lora_equals_torch_and_peft(llama_dir, llama_adapters):
    reqs = [LoRARequest("attn", 1, str(llama_adapters["attn"])),
            LoRARequest("all", 2, str(llama_adapters["all"]))]
    loras = [reqs[0], None, reqs[1]]
    tri = make_llm(llama_dir, attention_backend="triton")
    punica = tri.llm_engine.executor.context.punica
    assert isinstance(punica, TritonPunica)
    kinds = []
    prepare = punica.prepare

    def spy(token_slots, query_lens):
        prepare(token_slots, query_lens)
        kinds.append("sgmv" if punica.plan.sgmv else "bgmv")

    punica.prepare = spy
    got = tokens(tri.generate(prompt_token_ids=PROMPTS, sampling_params=greedy(N),
                              lora_request=loras))
    assert {"sgmv", "bgmv"} <= set(kinds)  # prefill steps segmented, decode steps per row
    torch_llm = make_llm(llama_dir)
    assert isinstance(torch_llm.llm_engine.executor.context.punica, TorchPunica)
    want_torch = tokens(torch_llm.generate(prompt_token_ids=PROMPTS, sampling_params=greedy(N),
                                           lora_request=loras))
    want_peft = [peft_greedy(llama_dir, None if r is None else r.lora_path, p, N)
                 for p, r in zip(PROMPTS, loras)]
    assert got == want_torch == want_peft
    assert want_peft[0] != peft_greedy(llama_dir, None, PROMPTS[0], N)  # the adapter matters

"""labkit's own PEFT-format writer: what it writes, peft reads, and transformers + peft then
generate what labkit's engine generates with the same folder."""

from __future__ import annotations

import pytest

from labkit import LoRARequest
from labkit.errors import LoRAError
from labkit.lora.writer import random_adapter, save_peft_adapter
from labkit.model.loader import load_model

from .conftest import peft_greedy
from .test_lora_engine import greedy, make_llm, tokens

PROMPT = [5, 17, 42, 8, 3, 9, 11]


def test_written_adapter_reads_back_in_peft_and_labkit(llama_dir, tmp_path):
    path = random_adapter(load_model(llama_dir), tmp_path / "w", ["q_proj", "v_proj", "up_proj",
                                                                  "down_proj"],
                          r=8, lora_alpha=16, seed=3, b_std=0.3, base_model=llama_dir)
    want = peft_greedy(llama_dir, path, PROMPT, 8)
    assert want != peft_greedy(llama_dir, None, PROMPT, 8)  # non-zero B: it changes the output
    got = tokens(make_llm(llama_dir).generate(prompt_token_ids=[PROMPT],
                                              sampling_params=greedy(8),
                                              lora_request=LoRARequest("w", 1, path)))[0]
    assert got == want


def test_writer_refuses_unserved_modules(tmp_path):
    import torch

    with pytest.raises(LoRAError, match="lm_head"):
        save_peft_adapter(tmp_path / "x", {"lm_head": (torch.zeros(2, 4), torch.zeros(4, 2))},
                          r=2, lora_alpha=2)

"""The adapters the lab ships (``datasets/models/labkit-tiny-lora-<style>``, made by
``labkit finetune --lora``): each is a PEFT folder that peft and labkit run alike, that changes
the base model's greedy output, and whose card's numbers say it specialised."""

from __future__ import annotations

import json

import pytest
import torch

from labkit.model.loader import models_dir
from tests.lora.conftest import peft, transformers

ADAPTERS = sorted(p for p in models_dir().glob("labkit-tiny-lora-*")
                  if (p / "adapter_config.json").is_file())
PROMPT = "def "


@pytest.fixture(scope="module")
def llm():
    from labkit import LLM

    return LLM(model="labkit-tiny", dtype=torch.float32, device="cpu", enable_lora=True,
               max_loras=2, max_lora_rank=8)


def test_two_styles_are_shipped():
    assert {p.name for p in ADAPTERS} >= {"labkit-tiny-lora-docstring", "labkit-tiny-lora-tests"}


@pytest.mark.parametrize("path", ADAPTERS, ids=lambda p: p.name)
def test_shipped_adapter_runs_like_peft_and_changes_output(llm, path):
    from labkit import LoRARequest, SamplingParams

    ids = llm.tokenizer.encode(PROMPT)
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    base = llm.generate(prompt_token_ids=[ids], sampling_params=sp, use_tqdm=False)
    got = llm.generate(prompt_token_ids=[ids], sampling_params=sp, use_tqdm=False,
                       lora_request=LoRARequest(path.name, 1 + ADAPTERS.index(path), str(path)))
    got_ids = list(got[0].outputs[0].token_ids)
    assert got_ids != list(base[0].outputs[0].token_ids)
    assert got_ids == _peft_greedy(path, ids, 24)


def _peft_greedy(adapter, prompt, n):
    """transformers + peft in float32 (the shipped base is stored in float16)."""
    model = transformers.AutoModelForCausalLM.from_pretrained(models_dir() / "labkit-tiny",
                                                              dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(model, str(adapter)).eval()
    x = torch.tensor([prompt])  # starts with EOT = id 0: an explicit mask, not pad inference
    with torch.no_grad():
        out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("path", ADAPTERS, ids=lambda p: p.name)
def test_card_shows_specialisation(path):
    log = json.loads((path / "finetune_log.json").read_text())
    own = log["heldout_losses"][log["style"]]
    assert own["adapter"] < own["base"]
    gains = {s: r["base"] - r["adapter"] for s, r in log["heldout_losses"].items()}
    assert max(gains, key=gains.get) == log["style"]  # it helps its own slice the most
    card = (path / "README.md").read_text()
    assert log["command"] in card and f"{own['adapter']:.4f}" in card
    assert (path / "adapter_model.safetensors").stat().st_size < 4_000_000

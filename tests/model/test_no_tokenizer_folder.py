"""A folder transformers' ``model.save_pretrained`` wrote (weights and config, no tokenizer)
runs through ``labkit.LLM(model=folder)`` on token ids, as vLLM's ``skip_tokenizer_init``: its
greedy output equals transformers', and a text prompt is a named error, not a crash."""

from __future__ import annotations

import pytest
import torch

from labkit.engine.llm import LLM
from labkit.engine.sampling_params import SamplingParams
from labkit.errors import InvalidPromptError
from labkit.model.loader import CheckpointError, load_pretrained

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("no_tok")
    model.save_pretrained(path)
    return path, model


def test_llm_runs_a_folder_without_tokenizer_on_token_ids(folder):
    path, hf = folder
    prompt = [3, 17, 42, 9, 100]
    llm = LLM(model=str(path), dtype=torch.float32, device="cpu", block_size=4)
    assert llm.tokenizer is None
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0, max_tokens=8, ignore_eos=True))[0].outputs[0].token_ids
    want = hf.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False,
                       min_new_tokens=8)[0, len(prompt):].tolist()
    assert list(out) == want
    with pytest.raises(InvalidPromptError, match="tokenizer"):
        llm.generate(["def f():"], SamplingParams(max_tokens=2))


def test_load_pretrained_still_names_the_missing_file(folder):
    path, _ = folder
    with pytest.raises(CheckpointError, match="no tokenizer.json"):
        load_pretrained(path)
    model, tok = load_pretrained(path, skip_tokenizer_init=True)
    assert tok is None and model.config.num_hidden_layers == 2

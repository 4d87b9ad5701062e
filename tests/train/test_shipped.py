"""The shipped checkpoints and the `labkit train --smoke` path, checked against transformers."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from labkit.model.config import ModelConfig
from labkit.model.generate import generate
from labkit.model.loader import load_pretrained
from labkit.train.cli import main

MODELS = Path(__file__).resolve().parents[2] / "datasets" / "models"
SHIPPED = {"labkit-tiny": (5_000_000, 5_600_000), "labkit-tiny-draft": (900_000, 1_200_000),
           "labkit-tiny-draft-distilled": (900_000, 1_200_000)}


def _shipped(name: str) -> Path:
    d = MODELS / name
    if not (d / "model.safetensors").is_file():
        pytest.skip(f"{name} is not in datasets/models")
    return d


def _greedy_both(path: Path, prompt: str, n: int) -> tuple[list[int], list[int]]:
    transformers = pytest.importorskip("transformers")
    model, tok = load_pretrained(path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(path))
    ids = tok.encode(prompt)
    assert hf_tok(prompt)["input_ids"] == ids
    ours = generate(model, ids, n, ignore_eos=True)
    x = torch.tensor([ids])
    with torch.no_grad():
        theirs = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                             min_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
    return ours, theirs


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_layout_and_parameter_count(name):
    d = _shipped(name)
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["model_type"] == "llama"
    mc = ModelConfig.from_hf_dict(cfg)
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    assert {t.dtype for t in tensors.values()} == {torch.float16}
    assert "lm_head.weight" not in tensors and mc.tie_word_embeddings
    n = sum(t.numel() for t in tensors.values())
    lo, hi = SHIPPED[name]
    assert n == mc.num_parameters() and lo < n < hi
    assert (d / "tokenizer.json").read_bytes() == (MODELS / "labkit-tiny" /
                                                    "tokenizer.json").read_bytes()
    log = json.loads((d / "train_log.json").read_text())
    card = (d / "README.md").read_text()
    assert f"{log['shipped']['heldout_loss_fp16_weights']:.4f}" in card
    assert f"{log['num_parameters']:,}" in card and log["command"] in card


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_transformers_greedy_equals_labkit(name):
    ours, theirs = _greedy_both(_shipped(name), "def fibonacci(n):", 24)
    assert ours == theirs


def test_target_continues_with_an_indented_body():
    model, tok = load_pretrained(_shipped("labkit-tiny"))
    text = tok.decode(generate(model, tok.encode("def fibonacci(n):"), 40))
    assert re.match(r"\n {4}\S", text), text  # a newline, then a 4-space-indented statement


def test_smoke_cli_end_to_end(tmp_path):
    out = tmp_path / "model"
    argv = ["--smoke", "--max-steps", "6", "--eval-every", "3", "--eval-max-tokens", "300",
            "--batch-size", "4", "--seq-len", "32", "--sample-tokens", "3", "--device", "cpu",
            "--cache-dir", str(tmp_path / "cache"), "--out", str(out)]
    assert main(argv) == 0
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
              "generation_config.json", "README.md", "train_log.json"):
        assert (out / f).is_file(), f
    log = json.loads((out / "train_log.json").read_text())
    assert log["steps"] == 6 and log["command"] == "labkit train " + " ".join(argv)
    ours, theirs = _greedy_both(out, "import json\n", 8)
    assert ours == theirs


def test_cli_rejects_bad_flags(capsys):
    with pytest.raises(SystemExit):
        main(["--preset", "gpt-5"])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--smoke", "--max-steps", "0"])
    assert "--max-steps must be >= 1" in capsys.readouterr().err

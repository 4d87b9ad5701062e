"""A random tiny checkpoint in Hugging Face layout, so bench tests never wait for the shipped
models: labkit and transformers both load it, which is all the benchmarks need."""

from pathlib import Path

import pytest
import torch

from labkit.model.testing import tiny_model
from labkit.sim.workloads import prompt_texts
from labkit.train.export import export_hf
from labkit.train.tokenizer import EOT_ID, save_tokenizer, train_tokenizer


def make_tiny_checkpoint(out: Path, vocab_size: int = 512, context: int = 512) -> Path:
    texts = prompt_texts("code_prompts") + prompt_texts("chat_prompts")
    texts += [Path(__file__).read_text(), Path(torch.__file__).read_text()]
    tok = train_tokenizer(texts, vocab_size=vocab_size)
    save_tokenizer(tok, out / "tok", model_max_length=context)
    model = tiny_model(0, vocab_size=tok.get_vocab_size(), max_position_embeddings=context,
                       tie_word_embeddings=True, bos_token_id=EOT_ID, eos_token_id=EOT_ID)
    cfg = model.config
    # Unit-scale random weights: every layer moves the residual stream, so greedy outputs vary
    # from token to token (a tiny-std init makes the model repeat one token forever).
    with torch.no_grad():
        for name, w in model.named_parameters():
            if w.dim() == 2:
                w.normal_(0.0, 1.0 if "embed" in name else 1.5 / w.shape[1] ** 0.5)
    return export_hf(model, cfg, out / "tok", out / "model", dtype=torch.float32)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("bench-ckpt"))

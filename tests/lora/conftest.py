"""Tiny random Llama / Qwen2 checkpoints (transformers' save_pretrained) and LoRA adapters made
by peft on them (get_peft_model + save_pretrained), shared by the LoRA tests.

peft initialises lora_B to zero (a fresh adapter is the base model), so every adapter here gets
a seeded random lora_B: otherwise "labkit with the adapter equals peft" would hold for an engine
that ignores adapters altogether."""

from __future__ import annotations

import pytest
import tokenizers
import torch

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

BASE = dict(vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
            max_position_embeddings=128, rms_norm_eps=1e-5, num_attention_heads=4,
            num_key_value_heads=2)
KINDS = {"llama": "LlamaConfig", "qwen2": "Qwen2Config"}


def save_base(path, kind="llama", seed=0, **overrides):
    """A random checkpoint plus a word-level tokenizer.json (one word per id), so that
    ``labkit.LLM(model=folder)`` loads it as it would a real one."""
    cfg = getattr(transformers, KINDS[kind])(**{**BASE, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    model.save_pretrained(path)
    vocab = {f"w{i}": i for i in range(cfg.vocab_size)}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    return path


def save_adapter(base_path, path, targets, r=8, alpha=16, seed=0, b_std=0.3, **lora_kw):
    """A peft LoRA adapter on the checkpoint at ``base_path`` with a seeded random lora_B."""
    base = transformers.AutoModelForCausalLM.from_pretrained(base_path)
    torch.manual_seed(seed)  # peft draws lora_A (kaiming) from the global generator
    model = peft.get_peft_model(base, peft.LoraConfig(r=r, lora_alpha=alpha,
                                                      target_modules=list(targets), **lora_kw))
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * b_std)
    model.save_pretrained(path)
    return path


def peft_greedy(base_path, adapter_path, prompt, max_new_tokens):
    """The reference: transformers (+ peft when ``adapter_path``) greedy generate."""
    model = transformers.AutoModelForCausalLM.from_pretrained(base_path)
    if adapter_path is not None:
        model = peft.PeftModel.from_pretrained(model, adapter_path)
    model.eval()
    with torch.no_grad():
        out = model.generate(input_ids=torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    return save_base(tmp_path_factory.mktemp("llama") / "base", "llama", seed=0)


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory):
    return save_base(tmp_path_factory.mktemp("qwen2") / "base", "qwen2", seed=1)


@pytest.fixture(scope="session")
def llama_adapters(tmp_path_factory, llama_dir):
    """Three adapters on the Llama base: attention only, MLP only, all seven projections."""
    d = tmp_path_factory.mktemp("llama-adapters")
    return {
        "attn": save_adapter(llama_dir, d / "attn", ["q_proj", "k_proj", "v_proj", "o_proj"],
                             r=8, alpha=16, seed=1),
        "mlp": save_adapter(llama_dir, d / "mlp", ["gate_proj", "up_proj", "down_proj"],
                            r=4, alpha=8, seed=2),
        "all": save_adapter(llama_dir, d / "all", ["q_proj", "k_proj", "v_proj", "o_proj",
                                                   "gate_proj", "up_proj", "down_proj"],
                            r=16, alpha=16, seed=3),
    }

"""The seeded tiny random model: a real Llama-family network small enough to run anywhere.

Tests, exercise checkers and notebooks need a model whose outputs are reproducible and that
needs no checkpoint: a 2-layer, 64-wide decoder with grouped-query attention (4 query heads
share 2 KV heads) and a 128-token vocabulary. Its weights are random, so its text is noise, but
every engine path must still reproduce ``generate`` token for token on it, which is what the
checks compare. One factory, so every caller means the same model by "the tiny model".

:func:`tiny_moe_checkpoint` is the mixture-of-experts counterpart: a seeded random Mixtral,
Qwen3-MoE or Qwen2-MoE written by transformers' ``save_pretrained`` (the reference is then
transformers itself, so it needs transformers installed).
"""

from __future__ import annotations

from pathlib import Path

import torch

from labkit.model.config import ModelConfig
from labkit.model.llama import LlamaForCausalLM

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256)


def tiny_config(**overrides) -> ModelConfig:
    """The tiny model's config; ``overrides`` change any field (e.g. ``sliding_window=6``)."""
    return ModelConfig(**{**TINY, **overrides})


def tiny_model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    """The tiny model in eval mode, its weights drawn after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_config(**overrides)).eval()


# Tiny random mixture-of-experts checkpoints (issue 28): transformers' config class and kwargs
# for each architecture labkit loads. 2-3 layers, 64 wide, 256-token vocabulary.
TINY_MOE = {
    "mixtral": ("MixtralConfig", dict(intermediate_size=48, num_local_experts=4,
                                      num_experts_per_tok=2)),
    "qwen3_moe": ("Qwen3MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32,
                                         num_experts=8, num_experts_per_tok=2,
                                         norm_topk_prob=True, head_dim=16)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(intermediate_size=96, moe_intermediate_size=32,
                                         shared_expert_intermediate_size=48, num_experts=8,
                                         num_experts_per_tok=2, num_hidden_layers=3,
                                         mlp_only_layers=[1])),
}


def tiny_moe_checkpoint(path, arch: str = "mixtral", seed: int = 0, **overrides):
    """Save a seeded random ``arch`` MoE (a key of :data:`TINY_MOE`) with transformers'
    ``save_pretrained`` into ``path``, plus a 256-token word-level ``tokenizer.json`` (tokens
    ``t0 .. t255``) so ``labkit.LLM(model=path)`` loads it; returns (transformers model, path).

    The router and experts are drawn wider than transformers' init (std 0.5 and 0.15) so that
    which experts a token picks, and with what weights, moves the logits well past 1e-4: a
    routing mistake cannot hide in the comparison. Norms and biases are perturbed likewise."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    cls_name, kw = TINY_MOE[arch]
    base = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5,
                eos_token_id=None, bos_token_id=None)
    cfg = getattr(transformers, cls_name)(**{**base, **kw, **overrides})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ".experts." in n or "shared_expert." in n:
                p.normal_(std=0.15)
            elif n.endswith(("mlp.gate.weight", "shared_expert_gate.weight")):
                p.normal_(std=0.5)
            elif "norm" in n or "bias" in n:
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(256)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(Path(path) / "tokenizer.json"))
    return model, Path(path)


def tiny_llama_checkpoint(path, seed: int = 0, **overrides) -> Path:
    """Save a seeded random Llama of the tiny model's shape (``overrides`` change the config)
    with transformers' ``save_pretrained`` into ``path``, plus a word-level ``tokenizer.json``
    (tokens ``t0 .. t127``), so ``labkit serve`` and ``LLM(model=path)`` load it as a real
    checkpoint (hot weight updates read such folders: two seeds are two versions)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    cfg = transformers.LlamaConfig(**{**TINY, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                                      "eos_token_id": None, "bos_token_id": None, **overrides})
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(cfg.vocab_size)},
                                     unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(Path(path) / "tokenizer.json"))
    return Path(path)

"""Model shapes and training settings of the models labkit ships (and of the smoke run).

labkit-tiny is a real Llama: GQA (8 query heads share 2 KV heads), SwiGLU, RoPE, tied
embeddings (the embedding table is a fifth of the parameters at this size; tying saves it and is
what small production models such as Qwen2.5-0.5B do). The draft shares its tokenizer and is five
times smaller, so speculative decoding has a cheap proposer whose tokens the target can verify.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from labkit.model.config import ModelConfig
from labkit.train.tokenizer import EOT_ID


@dataclass(frozen=True)
class Preset:
    name: str
    model: ModelConfig
    seq_len: int
    batch_size: int
    lr: float
    warmup_steps: int
    max_epochs: float | None  # cap on passes over the train stream when training by time
    eval_every: int
    vocab_size: int = 4096
    include: tuple[str, ...] | None = None  # corpus subset (smoke run only)
    # MoE only: coefficients of the load-balancing and router z auxiliary losses (moe_loss.py)
    aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0


def _llama(vocab: int, hidden: int, inter: int, layers: int, heads: int, kv_heads: int,
           context: int) -> ModelConfig:
    return ModelConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=hidden // heads,
        max_position_embeddings=context, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=EOT_ID, eos_token_id=EOT_ID)


def _mixtral(vocab: int, hidden: int, expert_inter: int, layers: int, heads: int,
             kv_heads: int, context: int, experts: int, top_k: int) -> ModelConfig:
    """Mixtral's layout: every layer sparse, softmax over all experts then top-k, renormalised
    (Mixtral's experts are as wide as ``intermediate_size``)."""
    return replace(_llama(vocab, hidden, expert_inter, layers, heads, kv_heads, context),
                   architecture="MixtralForCausalLM", num_experts=experts,
                   num_experts_per_tok=top_k, norm_topk_prob=True)


PRESETS: dict[str, Preset] = {
    # 5.28 M parameters (4.23 M outside the embedding).
    "labkit-tiny": Preset("labkit-tiny", _llama(4096, 256, 704, 6, 8, 2, 1024), seq_len=1024,
                          batch_size=64, lr=2e-3, warmup_steps=100, max_epochs=16.0,
                          eval_every=100),
    # 1.02 M parameters: two layers so a draft step costs a third of a target step.
    "labkit-tiny-draft": Preset("labkit-tiny-draft", _llama(4096, 128, 512, 2, 4, 2, 1024),
                                seq_len=1024, batch_size=64, lr=3e-3, warmup_steps=100,
                                max_epochs=16.0, eval_every=100),
    # A Mixtral-layout MoE small enough to train on a CPU in minutes: 8 experts of 176, top-2,
    # 1.22 M active parameters per token of 2.87 M stored (5.7 MB of float16).
    "labkit-tiny-moe": Preset("labkit-tiny-moe", _mixtral(4096, 128, 176, 4, 4, 2, 1024, 8, 2),
                              seq_len=256, batch_size=8, lr=3e-3, warmup_steps=20,
                              max_epochs=16.0, eval_every=50, aux_loss_coef=0.01,
                              z_loss_coef=0.001),
    # Its dense twin: the same active parameters (one FFN of 352 = two experts' width), trained
    # with the same command, so the card can say whether the experts bought anything.
    "labkit-tiny-moe-dense": Preset("labkit-tiny-moe-dense", _llama(4096, 128, 352, 4, 4, 2, 1024),
                                    seq_len=256, batch_size=8, lr=3e-3, warmup_steps=20,
                                    max_epochs=16.0, eval_every=50),
    # About a minute on a CPU: a slice of the stdlib (with held-out files) + the help topics.
    "smoke": Preset("smoke", _llama(1024, 64, 128, 2, 4, 2, 256), seq_len=128, batch_size=16,
                    lr=3e-3, warmup_steps=20, max_epochs=None, eval_every=50, vocab_size=1024,
                    include=("json/", "sched.py", "copyreg.py", "textwrap.py", "heapq.py")),
}


def get_preset(name: str, vocab_size: int | None = None) -> Preset:
    """A preset by name; `vocab_size` overrides the model's (the tokenizer decides it)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    p = PRESETS[name]
    if vocab_size is not None and vocab_size != p.model.vocab_size:
        p = replace(p, model=replace(p.model, vocab_size=vocab_size))
    return p

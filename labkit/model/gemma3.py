"""Gemma 3's text decoder (``Gemma3ForCausalLM``): labkit's Llama parts, rearranged.

What differs from :mod:`labkit.model.llama`, each written once here::

    x = embed(ids) * sqrt(hidden)                          # scaled embeddings
    per layer (5 sliding "local" layers : 1 full "global" layer, layer_types):
        h = post_attention_norm(attn(input_norm(x)))       # sandwich norms:
        x = x + h                                          # 4 RMSNorms per layer
        x = x + post_feedforward_norm(mlp(pre_feedforward_norm(x)))
    attn: q_norm / k_norm per head (QK-norm), softmax scale query_pre_attn_scalar^-0.5,
          rope base rope_local_base_freq (local) or rope_theta / linear factor (global)
    mlp:  down(gelu_tanh(gate(x)) * up(x))
    logits = cap * tanh(logits / cap)                      # final_logit_softcapping, if set

Gemma's RMSNorm multiplies by ``1 + weight`` (weights stored as offsets from 1, zero-initialised),
computed in float32. **Why two rope bases:** local layers only ever see the last
``sliding_window`` positions, so a small base (10k) keeps their rotations distinct at short range,
while global layers use a large base (1M, optionally stretched) to separate positions across the
whole context; the KV cache keeps each layer's keys rotated by its own base.

**The cache seam is unchanged**: the attention is :class:`~labkit.model.llama.Attention` (same
names, same ``kv_cache.attend``); its query is pre-multiplied so the caches' fixed
``head_dim^-0.5`` scale becomes ``query_pre_attn_scalar^-0.5``. The layer layout (which layers
slide, how far) comes from :meth:`~labkit.model.config.ModelConfig.layer_spec` like every model.
Attention logit softcapping (Gemma 2's) and bidirectional attention are refused when the config
is read (:mod:`labkit.model.config_sliding`); features that assume Llama's layer (fused norms,
piecewise compilation, quantization, TP, ...) refuse Gemma 3 by name
(:func:`labkit.model.config_sliding.refuse_family`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from labkit.model.config import ModelConfig
from labkit.model.llama import (
    CAUSAL_LM_CLASSES,
    MLP,
    Attention,
    KVCache,
    LlamaForCausalLM,
    rope_cos_sin,
)


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in float32, cast back once (transformers' Gemma3RMSNorm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class Gemma3Attention(Attention):
    """Llama's attention with Gemma's QK-norm and ``query_pre_attn_scalar`` scale."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        # the caches scale q.k by head_dim^-0.5; Gemma wants query_pre_attn_scalar^-0.5
        self.q_scale = (config.head_dim / config.gemma3.query_pre_attn_scalar) ** 0.5

    def qkv_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().qkv_rope(x, cos, sin)
        return q * self.q_scale, k, v


class GemmaMLP(MLP):
    """GeGLU with the tanh approximation: down(gelu_tanh(gate(x)) * up(x))."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    """Sandwich norms: each sublayer's output is normalised before the residual add."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.is_sliding = config.layer_spec(layer_idx).sliding_window is not None
        self.self_attn = Gemma3Attention(config, layer_idx)
        self.mlp = GemmaMLP(config)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x, cos, sin, positions, kv_cache):
        i = int(self.is_sliding)  # cos/sin [2, ...]: global rope, local rope
        h = self.self_attn(self.input_layernorm(x), cos[i], sin[i], positions, kv_cache)
        x = x + self.post_attention_layernorm(h)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.normalizer = config.hidden_size ** 0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor, kv_cache: KVCache | None) -> torch.Tensor:
        x = x * torch.tensor(self.normalizer, dtype=x.dtype)  # as transformers rounds it
        for layer in self.layers:
            x = layer(x, cos, sin, positions, kv_cache)
        return self.norm(x)


class Gemma3ForCausalLM(LlamaForCausalLM):
    """The whole text model; ``forward`` is Llama's plus the final logit softcap."""

    def __init__(self, config: ModelConfig) -> None:
        nn.Module.__init__(self)
        if config.gemma3 is None:
            raise ValueError("Gemma3ForCausalLM needs a Gemma 3 config (ModelConfig.gemma3)")
        self.config = config
        self.model = Gemma3Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(self._init_weights)

    def rope(self, positions: torch.Tensor, dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [2, B, T, D]: index 0 for global layers (``rope_theta``, positions divided
        by the linear factor), 1 for local ones (``rope_local_base_freq``)."""
        c, g = self.config, self.config.gemma3
        pos = positions.float() / g.rope_scaling_factor if g.rope_scaling_factor != 1 else positions
        full = rope_cos_sin(pos, c.head_dim, c.rope_theta, dtype)
        local = rope_cos_sin(positions, c.head_dim, g.rope_local_base_freq, dtype)
        return torch.stack([full[0], local[0]]), torch.stack([full[1], local[1]])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                kv_cache: KVCache | None = None,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        logits = super().forward(input_ids, positions, kv_cache, logits_indices)
        cap = self.config.gemma3.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap


CAUSAL_LM_CLASSES["Gemma3ForCausalLM"] = Gemma3ForCausalLM


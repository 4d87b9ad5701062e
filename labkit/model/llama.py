"""A Llama-family decoder in one file: RMSNorm, rotary embeddings, GQA attention, SwiGLU.

Read it top to bottom. Parameter names equal Hugging Face's, so a checkpoint's safetensors load
with no renaming, and every linear layer is a plain ``nn.Linear`` so quantization can swap it.

The one idea an inference engine needs from the model is *where the KV cache plugs in*. Each
attention layer computes q, k, v for the new tokens, rotates q and k, then hands them to
``kv_cache.attend(layer_idx, q, k, v, positions)``. The cache decides where k and v live (one
contiguous tensor per sequence for the reference `generate`, scattered fixed-size blocks for the
paged engine) and returns the attention output. Without a cache the layer runs plain causal
attention over the tokens it was given.

Each decoder layer takes its attention and MLP from :mod:`labkit.model.layers`, which builds them
from the config's per-layer spec (full or sliding attention, DeepSeek's latent attention of
:mod:`labkit.model.mla`, dense MLP, or the sparse MoE MLPs of :mod:`labkit.model.moe` and
:mod:`labkit.model.deepseek_moe`). The classes here register themselves there as the kinds
labkit ships. Qwen3's per-head q/k RMSNorm (``config.qk_norm``) is two optional modules of
``Attention``, applied after the projection and before rotary, absent in every other model.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from labkit.model.config import ModelConfig
from labkit.model.layers import make_attention, make_mlp, register_attention, register_mlp
from labkit.model.rope import yarn_parameters
from labkit.model.sinks import attention_with_sinks


class KVCache(Protocol):
    def attend(self, layer_idx: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               positions: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """Store k, v [B,T,Hkv,D] for these positions; return attention output [B,T,Hq,D].
        ``sinks`` [Hq]: the layer's attention-sink logits (gpt-oss, :mod:`labkit.model.sinks`);
        a layer without them never passes the argument."""
        ...


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 as Llama does (low precision loses the mean).

    With ``residual`` it is vLLM's fused add + norm: returns ``(norm(x + residual), x +
    residual)``, the residual add that precedes every norm in a decoder done in the same call
    (one pass over the hidden state when a kernel runs it, ``kernels/rms_norm.py``;
    :mod:`labkit.model.fuse` routes the layers through it)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = residual = x + residual  # rounded to the model dtype: it is the residual stream
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * h.to(dtype)
        return y if residual is None else (y, residual)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype,
                 rope_scaling: dict | None = None, max_position_embeddings: int = 0
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin for each position: angle = pos * theta^(-2i/d), halves repeated (rotate-half).
    A YaRN ``rope_scaling`` (DeepSeek-V3) changes the frequencies and multiplies cos and sin by
    its attention factor (:func:`labkit.model.rope.yarn_parameters`)."""
    if rope_scaling:
        inv_freq, factor = yarn_parameters(rope_scaling, head_dim, theta, max_position_embeddings)
        inv_freq = inv_freq.to(positions.device)
    else:
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                                 dtype=torch.float32) / head_dim))
    angles = positions.float()[..., None] * inv_freq  # [..., D/2]
    emb = torch.cat([angles, angles], dim=-1)
    if rope_scaling:
        return (emb.cos() * factor).to(dtype), (emb.sin() * factor).to(dtype)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x_i, x_{i+D/2}) by the position's angle. x [B,T,H,D], cos/sin [B,T,D]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     sliding_window: int | None = None, scale: float | None = None,
                     sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Plain causal attention with GQA, q [B,T,Hq,D], k/v [B,S,Hkv,D], queries at the end.
    ``scale`` defaults to 1/sqrt(D) (MLA passes its own; its V may be narrower than Q/K).
    ``sinks`` [Hq]: per-head sink logits in the softmax's denominator (gpt-oss,
    :mod:`labkit.model.sinks`)."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B,H,T,D]
    if group > 1:
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
    T, S = q.shape[2], k.shape[2]
    qpos = torch.arange(S - T, S, device=q.device)[:, None]
    kpos = torch.arange(S, device=q.device)[None, :]
    mask = kpos <= qpos
    if sliding_window is not None:
        mask &= kpos > qpos - sliding_window
    if sinks is not None:
        d = q.shape[-1]
        out = attention_with_sinks(q, k, v, mask, d ** -0.5 if scale is None else scale, sinks)
        return out.transpose(1, 2)
    return sdpa(q, k, v, mask, scale).transpose(1, 2)


_FUSED_CPU_KERNEL_FAILS: set[torch.dtype] = set()  # dtypes sdpa runs with the math kernel


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
         scale: float | None) -> torch.Tensor:
    """``F.scaled_dot_product_attention``, falling back to PyTorch's math kernel where the fused
    CPU kernel raises. Why: torch 2.13's bf16/fp16 flash kernel on a CPU with AMX packs its
    tiles with AVX-512 code (``pack_vnni2``) even when ``ATEN_CPU_CAPABILITY=avx2`` caps the
    vector ISA (how the lab's CI runs another CPU's kernels), and raises for 64+ tokens. The
    fallback is decided once per dtype; any other error propagates."""
    if q.dtype not in _FUSED_CPU_KERNEL_FAILS:
        try:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
        except RuntimeError as e:
            if "pack_vnni" not in str(e):
                raise
            _FUSED_CPU_KERNEL_FAILS.add(q.dtype)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


@register_attention("full", "sliding")
class Attention(nn.Module):
    """GQA attention; a "sliding" layer's queries see only its last ``sliding_window`` keys.
    With ``config.attention_sinks`` (gpt-oss) each head has a learned sink logit ``sinks``
    (:mod:`labkit.model.sinks`), handed to the cache as ``attend(..., sinks=self.sinks)``."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.rope_theta = config.rope_theta
        self.sliding_window = config.layer_spec(layer_idx).sliding_window
        h, d, b = config.hidden_size, config.head_dim, config.attention_bias
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=b)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=b)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=b)
        # Llama/Mistral's attention_bias also covers o_proj; Qwen2 biases only q, k, v.
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=config.o_proj_bias)
        self.qk_norm = config.qk_norm
        if self.qk_norm:  # Qwen3: RMSNorm over each head of q and k, before rotary
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads)) if config.attention_sinks else None

    def project_qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The one place q, k, v are projected: a fused-qkv transform replaces only this."""
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def qkv_rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Everything before the KV cache: project, split into heads, (q/k norm), rotate.
        A piecewise-compiled forward (:mod:`labkit.engine.piecewise`) compiles this part."""
        B, T, _ = x.shape
        q, k, v = self.project_qkv(x)
        q = q.view(B, T, self.num_heads, self.head_dim)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        v = v.view(B, T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor, kv_cache: KVCache | None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv_rope(x, cos, sin)
        if kv_cache is None:
            out = causal_attention(q, k, v, self.sliding_window, sinks=self.sinks)
        elif self.sinks is not None:  # only a sink layer passes the argument
            out = kv_cache.attend(self.layer_idx, q, k, v, positions, sinks=self.sinks)
        else:
            out = kv_cache.attend(self.layer_idx, q, k, v, positions)
        return self.o_proj(out.reshape(B, T, self.num_heads * self.head_dim))


@register_mlp("dense")
class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)). ``intermediate_size`` overrides the config's width
    (Qwen2-MoE's shared expert is one of these, narrower or wider than the dense layers)."""

    def __init__(self, config: ModelConfig, layer_idx: int | None = None,
                 intermediate_size: int | None = None) -> None:
        super().__init__()
        h, i = config.hidden_size, intermediate_size or config.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False)
        self.up_proj = nn.Linear(h, i, bias=False)
        self.down_proj = nn.Linear(i, h, bias=False)

    def gate_up(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The one place gate and up are projected: a fused gate|up transform replaces this."""
        return self.gate_proj(x), self.up_proj(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    """Pre-norm residual block; what its attention and MLP are comes from the layer's spec."""

    def __init__(self, config: ModelConfig, layer_idx: int) -> None:
        super().__init__()
        self.self_attn = make_attention(config, layer_idx)
        self.mlp = make_mlp(config, layer_idx)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, positions, kv_cache):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, positions, kv_cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                positions: torch.Tensor, kv_cache: KVCache | None) -> torch.Tensor:
        """The decoder stack and the final norm over embedded tokens ``x`` [B,T,H] (the fused
        transform, :func:`labkit.model.fuse.fuse_add_norm`, replaces this loop only)."""
        for layer in self.layers:
            x = layer(x, cos, sin, positions, kv_cache)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """The whole model. ``forward`` returns logits; see the module docstring for the cache.
    An architecture whose decoder differs beyond the layer registries (Gemma 3) subclasses it
    and registers in :data:`CAUSAL_LM_CLASSES`; loaders build :func:`causal_lm_class`."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.model = LlamaModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def rope(self, positions: torch.Tensor, dtype: torch.dtype
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """The one place the rotary cos/sin of a step are made (recomputed from the positions);
        :func:`labkit.model.fuse.use_rope_table` replaces it by a lookup in a table."""
        c = self.config
        return rope_cos_sin(positions, c.head_dim, c.rope_theta, dtype, c.rope_scaling,
                            c.max_position_embeddings)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                kv_cache: KVCache | None = None,
                logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [B,T] -> logits [B,T,V], or [len(logits_indices), V] if indices are given.

        positions defaults to 0..T-1. logits_indices index the flattened B*T tokens: an engine
        that packs many sequences into one row only needs each sequence's last token's logits,
        and the vocabulary projection is the largest matmul in a small model.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        if int(positions.max()) >= self.config.max_position_embeddings:
            raise ValueError(f"position {int(positions.max())} is beyond the model's context of "
                             f"{self.config.max_position_embeddings} tokens")
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rope(positions, x.dtype)
        x = self.model(x, cos, sin, positions, kv_cache)
        if logits_indices is not None:
            x = x.reshape(B * T, -1)[logits_indices]
        return self.lm_head(x)


# architecture -> its causal-LM class, for those that are not LlamaForCausalLM (Gemma 3,
# labkit.model.gemma3, registers itself); the checkpoint loaders build causal_lm_class(config)
CAUSAL_LM_CLASSES: dict[str, type[LlamaForCausalLM]] = {}


def causal_lm_class(config: ModelConfig) -> type[LlamaForCausalLM]:
    """The class that builds a model of ``config.architecture``."""
    return CAUSAL_LM_CLASSES.get(config.architecture, LlamaForCausalLM)

"""LeanDraft: the draft model's forward with fewer, fused tensor ops (the same math).

Why: a draft model pays only if its forward costs a small fraction c of the target's. On a CPU a
~1 M-parameter Llama does almost no arithmetic per token; its forward time is the fixed cost of
each tensor op and ``nn.Module`` call (a few microseconds each, ~40 per layer), so a 2-layer
draft of width 128 costs ~0.4 of a 6-layer target of width 256, not the ~0.1 its FLOPs say.
This forward runs the draft's weights with a fraction of the calls, per layer:

* q, k, v from ONE matmul (the three weights concatenated), gate and up from one;
* each RMSNorm's weight folded into the matmul after it (the norm itself stays float32, like
  :class:`~labkit.model.llama.RMSNorm`);
* rotary embeddings: cos/sin looked up in a table built once, q and k rotated in one pass;
* no ``nn.Module`` dispatch: plain functions over the weight tensors.

Attention still goes through the cache's ``attend`` (the paged backend), so the draft's KV lives
where :class:`~labkit.spec.proposers.DraftModelProposer` expects it. Logits equal the model's up
to float rounding (tests/spec/test_lean_draft.py); a draft's numerics can only change which
drafts are proposed, never the output, because the target verifies every token.

``LeanEagle`` is the same forward for an EAGLE head (:mod:`labkit.spec.eagle`): its ``fc``,
its one fused layer, the target's final norm folded into the target's LM head.

The weights are copied (fused) at construction: build it after the draft is loaded or trained.
Models it does not cover (biases, sliding windows, quantized or other swapped linears, Qwen3's
q/k norms) keep the module forward (:func:`lean_draft` returns None); a mixture-of-experts draft
does too, and building ``LeanDraft`` on one directly raises
:class:`~labkit.errors.MoEUnsupportedError` (its fused layer is one dense gate|up and down).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from labkit.model.layers import layer_sliding_windows
from labkit.model.llama import LlamaForCausalLM, rope_cos_sin
from labkit.model.moe import refuse_moe


@dataclass
class _Layer:
    qkv: torch.Tensor  # [(Hq + 2 Hkv) D, h], the input norm's weight folded in
    o: torch.Tensor
    gate_up: torch.Tensor  # [2 I, h], the post-attention norm's weight folded in
    down: torch.Tensor


def _slides(cfg: object) -> bool:
    """Any layer with a sliding window (every layer, Mistral, or some, per ``layer_types``): the
    lean forward has no window mask of its own to pass along."""
    return any(w is not None for w in layer_sliding_windows(cfg))


def _plain(model: nn.Module) -> bool:
    """Only a bias-free, full-attention Llama of plain ``nn.Linear`` layers is covered."""
    if type(model) is not LlamaForCausalLM:
        return False
    cfg = model.config
    if (_slides(cfg) or cfg.attention_bias or cfg.o_proj_bias or cfg.qk_norm or cfg.moe_layers
            or cfg.mla):  # latent attention has no q/k/v_proj
        return False
    linears = [model.lm_head] + [
        m for layer in model.model.layers
        for m in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                  layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj,
                  layer.mlp.down_proj)]
    return all(type(m) is nn.Linear and m.bias is None for m in linears)


def _fuse(layer: nn.Module) -> _Layer:
    """One decoder layer's weights, fused (q|k|v, gate|up) with its norms' weights folded in."""
    a, m = layer.self_attn, layer.mlp
    return _Layer(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])
                  * layer.input_layernorm.weight, a.o_proj.weight.detach(),
                  torch.cat([m.gate_proj.weight, m.up_proj.weight])
                  * layer.post_attention_layernorm.weight, m.down_proj.weight.detach())


class _Lean:
    """What a fused forward needs besides its layers: the config, the final-norm-folded LM head,
    a rotary table, weight-free RMSNorm and one decoder layer's forward."""

    def __init__(self, config, lm_head: torch.Tensor) -> None:
        self.config = config
        self.eps = config.rms_norm_eps
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.lm_head = lm_head.detach()
        # the same cos/sin rope_cos_sin computes per step, for every position at once
        pos = torch.arange(config.max_position_embeddings, device=self.device)
        self.cos, self.sin = rope_cos_sin(pos, config.head_dim, config.rope_theta, self.dtype)

    @property
    def device(self) -> torch.device:
        return self.lm_head.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.dtype

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm without its weight (folded into the next matmul), in float32."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf if x.dtype == torch.float32 else xf.to(x.dtype)

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if int(positions.max()) >= self.config.max_position_embeddings:
            raise ValueError(f"position {int(positions.max())} is beyond the draft's context "
                             f"of {self.config.max_position_embeddings} tokens")
        B, T = positions.shape
        flat = positions.reshape(-1)
        return (self.cos.index_select(0, flat).view(B, T, 1, self.head_dim),
                self.sin.index_select(0, flat).view(B, T, 1, self.head_dim))

    def _layer(self, i: int, w: _Layer, x: torch.Tensor, rope: tuple, positions: torch.Tensor,
               kv_cache) -> torch.Tensor:
        B, T, _ = x.shape
        Hq, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        cos, sin = rope
        half = D // 2
        qkv = F.linear(self._norm(x), w.qkv).view(B, T, Hq + 2 * Hkv, D)
        qk = qkv[:, :, :Hq + Hkv]
        qk = qk * cos + torch.cat([-qk[..., half:], qk[..., :half]], dim=-1) * sin
        out = kv_cache.attend(i, qk[:, :, :Hq], qk[:, :, Hq:], qkv[:, :, Hq + Hkv:], positions)
        x = x + F.linear(out.reshape(B, T, Hq * D), w.o)
        g, u = F.linear(self._norm(x), w.gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(g) * u, w.down)


class LeanDraft(_Lean):
    """Callable like the model (``input_ids, positions, kv_cache, logits_indices``), with its
    ``config``, ``dtype`` and ``device``, so a :class:`~labkit.engine.model_runner.ModelRunner`
    runs it unchanged."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        refuse_moe(model.config, "the lean draft (LeanDraft)")
        if not _plain(model):
            raise ValueError("LeanDraft covers a plain LlamaForCausalLM (no biases, no sliding-"
                             "window layers, nn.Linear layers); run other drafts through the "
                             "module")
        self.model = model
        with torch.no_grad():
            m = model.model
            # an RMSNorm's weight scales the input channels of the matmul after it: fold it in
            super().__init__(model.config, model.lm_head.weight * m.norm.weight)
            self.embed = m.embed_tokens.weight.detach()
            self.layers = [_fuse(layer) for layer in m.layers]

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor | None, kv_cache,
                 logits_indices: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [B, T] (the engine packs one row) -> logits [B, T, V], or of the
        ``logits_indices`` rows of the flattened tokens; positions default to 0 .. T-1."""
        B, T = input_ids.shape
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        rope = self._rope(positions)
        x = F.embedding(input_ids, self.embed)
        for i, w in enumerate(self.layers):
            x = self._layer(i, w, x, rope, positions, kv_cache)
        x = self._norm(x)
        if logits_indices is not None:
            x = x.reshape(B * T, -1).index_select(0, logits_indices)
        return F.linear(x, self.lm_head)


class LeanEagle(_Lean):
    """The same fused forward for an EAGLE head (:class:`~labkit.spec.eagle.EagleDraft`): fc,
    its one layer, then the target's final norm (folded) and LM head. Like the module it takes
    ``features`` and leaves the predicted features of the selected rows in ``last_hidden``."""

    def __init__(self, head: nn.Module) -> None:
        embed, norm, lm_head = head.shared
        with torch.no_grad():
            super().__init__(head.config, lm_head.weight * norm.weight)
            self.embed = embed.weight.detach()
            self.fc = head.fc.weight.detach()
            self.layer = _fuse(head.layer)
        self.last_hidden: torch.Tensor | None = None

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor | None, kv_cache,
                 logits_indices: torch.Tensor | None = None,
                 features: torch.Tensor | None = None) -> torch.Tensor:
        B, T = input_ids.shape
        if features is None:
            raise ValueError("an EAGLE head needs the target's features beside the tokens")
        if positions is None:
            positions = torch.arange(T, device=input_ids.device).expand(B, T)
        x = F.linear(torch.cat([F.embedding(input_ids, self.embed),
                                features.to(self.dtype)], dim=-1), self.fc)
        h = self._layer(0, self.layer, x, self._rope(positions), positions, kv_cache)
        if logits_indices is not None:
            h = h.reshape(B * T, -1).index_select(0, logits_indices)
        self.last_hidden = h
        return F.linear(self._norm(h), self.lm_head)


def _plain_eagle(head: nn.Module) -> bool:
    from labkit.spec.eagle import EagleDraft

    if type(head) is not EagleDraft:
        return False
    cfg, a, m = head.config, head.layer.self_attn, head.layer.mlp
    if _slides(cfg) or cfg.attention_bias or cfg.o_proj_bias or cfg.qk_norm:
        return False
    linears = (head.fc, head.shared[2], a.q_proj, a.k_proj, a.v_proj, a.o_proj, m.gate_proj,
               m.up_proj, m.down_proj)
    return all(type(x) is nn.Linear and x.bias is None for x in linears)


def lean_draft(model: nn.Module) -> LeanDraft | LeanEagle | None:
    """A fused forward of ``model`` (a draft model or an EAGLE head), or None where it does
    not cover the model."""
    if _plain(model):
        return LeanDraft(model)
    return LeanEagle(model) if _plain_eagle(model) else None

"""LoRA on the model's linear layers: a post-load transform, like quantization's module swap.

:func:`apply_lora` wraps every q/k/v/o/gate/up/down projection of the loaded model (found by
name, as ``labkit.quant`` finds what it swaps) in a :class:`LoRALinear`. The wrapper keeps the
base layer as it is and holds the *slots*: stacked adapter weights for every adapter that may
run at once,

    lora_a [S, r, H_in]   lora_b [S, H_out, r]   scalings [S]   (S = max_loras, r = max_lora_rank)

and adds, for each token, ``scaling * B (A x)`` of the slot that token's request uses (slot -1,
the base model, adds nothing). Adapters of lower rank are zero-padded to r; a layer an adapter
does not target keeps zeros in its slot. So one forward serves a batch mixing the base model and
up to S adapters, and switching adapters is copying weights into a slot, never touching the
base weights (vLLM's ``BaseLinearLayerWithLoRA``).

Which slot each token uses is set once per forward on the one :class:`LoRAContext` all layers
share (vLLM's punica wrapper ``update_metadata``); the layers only read it. Outside the engine
(no context set) the wrapped model is the base model.

Fused projections (``labkit.model.fuse``) work per output slice: the fused ``project_qkv`` /
``gate_up`` run one concatenated matmul and never call the per-projection modules, so for a
fused layer the transform also replaces those two seams with one that splits the fused output
as before and adds each slice's delta through that projection's :class:`LoRALinear`
(:meth:`LoRALinear.add_lora`; the slices are exactly the HF weights q, k, v / gate, up). The
base arithmetic stays one matmul; only the low-rank parts are per projection (as vLLM's
``MergedColumnParallelLinearWithLoRA`` does).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from labkit.errors import LoRAError
from labkit.lora.adapter import SUPPORTED_MODULES
from labkit.lora.ops import bgmv_expand, bgmv_shrink


class LoRAContext:
    """The step's per-token slot ids, shared by every LoRA layer of one model. ``shrink`` and
    ``expand`` are the batched-delta ops (:mod:`labkit.lora.ops`'s signatures); ``punica``, if
    given, supplies all three of ``prepare`` / ``shrink`` / ``expand`` instead (the Triton
    kernels, :class:`~labkit.lora.punica.TritonPunica`), and is prepared once per forward with
    the step's chunk lengths so it can choose SGMV or BGMV for every layer at once."""

    def __init__(self, shrink: Callable = bgmv_shrink, expand: Callable = bgmv_expand,
                 punica: Any = None) -> None:
        self.token_slots: torch.Tensor | None = None
        self.any_lora = False  # some token of this step has an adapter
        self.punica = punica
        self.shrink = punica.shrink if punica is not None else shrink
        self.expand = punica.expand if punica is not None else expand

    def add_lora(self, x: torch.Tensor, y: torch.Tensor, layer: LoRALinear) -> None:
        """Add ``layer``'s per-token deltas for ``x [T, in]`` into ``y [T, out]`` in place:
        through the punica object when there is one (it may use the layer's packed weights,
        :class:`~labkit.lora.punica.TorchPunica`), else shrink then expand."""
        if self.punica is not None:
            self.punica.add_lora(x, y, layer)
        else:
            self.expand(y, self.shrink(x, layer.lora_a, self.token_slots), layer.lora_b,
                        self.token_slots, layer.scalings)

    def update_metadata(self, token_slots: torch.Tensor,
                        query_lens: list[int] | None = None) -> None:
        """Set this forward's slot per token (int64 ``[T]``, -1 = base); ``query_lens`` are
        the chunks' token counts (None: unknown, treated as decode rows)."""
        self.token_slots = token_slots
        self.any_lora = bool((token_slots >= 0).any())
        if self.punica is not None and self.any_lora:
            self.punica.prepare(token_slots, query_lens)

    def clear(self) -> None:
        self.token_slots, self.any_lora = None, False
        if self.punica is not None:
            self.punica.clear()


class LoRALinear(nn.Module):
    """A base linear layer plus ``max_loras`` adapter slots (see the module doc)."""

    def __init__(self, base: nn.Module, context: LoRAContext, max_loras: int, max_rank: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base_layer = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.context = context
        kw = {"dtype": dtype, "device": device}
        # non-persistent: the state dict keeps only the base weights
        self.register_buffer("lora_a", torch.zeros(max_loras, max_rank, self.in_features, **kw),
                             persistent=False)
        self.register_buffer("lora_b", torch.zeros(max_loras, self.out_features, max_rank, **kw),
                             persistent=False)
        self.register_buffer("scalings", torch.zeros(max_loras, **kw), persistent=False)
        # every slot's B, transposed and scaled, stacked: [S*r, H_out]. One addmm then adds
        # each row's own delta (TorchPunica); kept in step with the slots by set_slot only
        self.register_buffer("lora_b_packed", torch.zeros(max_loras * max_rank,
                                                          self.out_features, **kw),
                             persistent=False)

    @torch.no_grad()
    def set_slot(self, slot: int, a: torch.Tensor | None, b: torch.Tensor | None,
                 scaling: float) -> None:
        """Copy one adapter's ``A [r, in]``, ``B [out, r]`` into ``slot`` (zero-padded to the
        slot rank); None (a layer the adapter does not target) clears the slot."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.scalings[slot] = 0.0
        rows = self.lora_b_packed.view(self.lora_a.shape[0], -1, self.out_features)[slot]
        rows.zero_()
        if a is None:
            return
        r = a.shape[0]
        self.lora_a[slot, :r].copy_(a)
        self.lora_b[slot, :, :r].copy_(b)
        self.scalings[slot] = scaling
        rows[:r].copy_(b.T * scaling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.add_lora(x, self.base_layer(x))

    def add_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """``y`` (this projection's base output for ``x``) plus each token's adapter delta.
        In place when ``y`` is contiguous; a fused layer's slice (a strided view) is copied
        first, so the fused output is never written through."""
        ctx = self.context
        if not ctx.any_lora:
            return y
        slots = ctx.token_slots
        x2, y2 = x.reshape(-1, self.in_features), y.reshape(-1, self.out_features)
        if x2.shape[0] != slots.shape[0]:  # a stale context would apply the wrong adapters
            raise RuntimeError(f"LoRA context has {slots.shape[0]} token slots for a forward "
                               f"of {x2.shape[0]} tokens")
        ctx.add_lora(x2, y2, self)
        return y2.view(y.shape)


def apply_lora(model: nn.Module, max_loras: int, max_lora_rank: int,
               context: LoRAContext | None = None) -> tuple[LoRAContext, dict[str, LoRALinear]]:
    """Wrap the model's projections in place; returns the shared context and the wrapped
    layers by module path (``model.layers.0.self_attn.q_proj``, PEFT's names)."""
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise LoRAError("the model already has LoRA layers (an engine was built on it with "
                        "enable_lora=True); load a fresh model")
    ctx = context or LoRAContext()
    dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
    found = [(name, m) for name, m in model.named_modules()
             if name.rsplit(".", 1)[-1] in SUPPORTED_MODULES and hasattr(m, "in_features")]
    layers: dict[str, LoRALinear] = {}
    for name, m in found:
        parent_name, _, attr = name.rpartition(".")
        wrapped = LoRALinear(m, ctx, max_loras, max_lora_rank, dtype, device)
        setattr(model.get_submodule(parent_name), attr, wrapped)
        layers[name] = wrapped
    if not layers:
        raise LoRAError("the model has no q/k/v/o/gate/up/down projections to adapt")
    _adapt_fused_seams(model)
    return ctx, layers


def _adapt_fused_seams(model: nn.Module) -> None:
    """For each fused q|k|v or gate|up (labkit.model.fuse), let the seam add the slices'
    deltas (see the module doc)."""
    for layer in getattr(getattr(model, "model", None), "layers", []):
        a, m = layer.self_attn, layer.mlp
        if hasattr(a, "qkv_proj"):
            a.project_qkv = _per_slice(a.qkv_proj, [a.q_proj, a.k_proj, a.v_proj])
        if hasattr(m, "gate_up_proj"):
            m.gate_up = _per_slice(m.gate_up_proj, [m.gate_proj, m.up_proj])


def _per_slice(fused: nn.Module, parts: list[LoRALinear]) -> Callable:
    def project(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(p.add_lora(x, y) for p, y in zip(parts, fused(x)))
    return project


def lora_targets(layers: dict[str, LoRALinear]) -> dict[str, tuple[int, int]]:
    """Module path -> (in_features, out_features): what an adapter is checked against."""
    return {name: (m.in_features, m.out_features) for name, m in layers.items()}

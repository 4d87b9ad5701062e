"""The LoRA ops behind :class:`~labkit.lora.layers.LoRAContext`, planned once per forward (vLLM's
punica wrapper): :class:`TritonPunica` (the Triton kernels, below) and :class:`TorchPunica`
(PyTorch, the engine's default; its own docstring says why it is not the per-slot loop).

With ``LLM(..., enable_lora=True, attention_backend="triton")`` every wrapped projection's delta
runs through ``kernels/lora_ops.py`` instead of the PyTorch loop of :mod:`labkit.lora.ops`.
Which kernel, decided once per forward in :meth:`TritonPunica.prepare` (vLLM's
``update_metadata``), never per layer:

- a step that holds a prefill chunk (some chunk has more than one token) uses **SGMV**: the
  token slots are cut into runs of one slot (a chunk's tokens share its request's adapter, and
  neighbouring chunks with the same adapter merge into one run), and each run is a segment that
  one tile GEMM per ``BLOCK_M`` rows serves against its adapter's factors. Decode rows mixed
  into such a step are segments of one row: correct, at the cost of a mostly masked tile;
- a pure decode step (every chunk one token) uses **BGMV**: one GEMV per row, whatever slot
  each row names, no segment bookkeeping and no padding of a row to a 16-row tile.

This is Punica's and vLLM's split (SGMV for prefill, BGMV for decode); using BGMV everywhere
would be simpler but reads an adapter's A and B once per prefill token instead of once per
``BLOCK_M`` tokens. The segment bounds are built on the host from the slot list the executor
already has, so the kernels never read a length back from the device (``max_seg_len`` given).

``TritonPunica`` keeps the ``shrink`` / ``expand`` signatures of :mod:`labkit.lora.ops` (the
token slots are passed and checked against the prepared plan), so the layers call either
implementation the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class _Plan:
    """One forward's kernel choice and, for SGMV, its segments."""

    token_slots: torch.Tensor
    sgmv: bool
    seg_starts: torch.Tensor | None = None
    seg_slots: torch.Tensor | None = None
    max_seg_len: int = 0


def segments(slots: list[int]) -> tuple[list[int], list[int]]:
    """Runs of equal slots: ``([0, 3, 5], [1, -1])`` for ``[1, 1, 1, -1, -1]`` (starts with the
    end appended, and each run's slot)."""
    starts, seg_slots = [], []
    for i, s in enumerate(slots):
        if not seg_slots or s != seg_slots[-1]:
            starts.append(i)
            seg_slots.append(s)
    return starts + [len(slots)], seg_slots


class TritonPunica:
    """``prepare(token_slots, query_lens)`` once per forward, then ``shrink`` / ``expand``
    per layer (see the module doc)."""

    def __init__(self) -> None:
        from labkit.kernels import lora_ops  # Triton is imported only when asked for

        self.ops = lora_ops
        self.plan: _Plan | None = None

    def prepare(self, token_slots: torch.Tensor, query_lens: list[int] | None) -> None:
        sgmv = query_lens is not None and max(query_lens, default=1) > 1
        plan = _Plan(token_slots, sgmv)
        if sgmv:
            starts, seg_slots = segments(token_slots.tolist())
            dev = token_slots.device
            plan.seg_starts = torch.tensor(starts, dtype=torch.int64, device=dev)
            plan.seg_slots = torch.tensor(seg_slots, dtype=torch.int64, device=dev)
            plan.max_seg_len = max(b - a for a, b in zip(starts, starts[1:]))
        self.plan = plan

    def _plan_for(self, token_slots: torch.Tensor) -> _Plan:
        plan = self.plan
        if plan is None or plan.token_slots is not token_slots:
            raise RuntimeError("TritonPunica used without prepare() for this forward's token "
                               "slots (LoRAContext.update_metadata calls it)")
        return plan

    def shrink(self, x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor
               ) -> torch.Tensor:
        p = self._plan_for(token_slots)
        if p.sgmv:
            return self.ops.sgmv_shrink(x, lora_a, p.seg_starts, p.seg_slots, p.max_seg_len)
        return self.ops.bgmv_shrink(x, lora_a, token_slots)

    def expand(self, y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor,
               token_slots: torch.Tensor, scalings: torch.Tensor) -> None:
        p = self._plan_for(token_slots)
        if p.sgmv:
            self.ops.sgmv_expand(y, buf, lora_b, p.seg_starts, p.seg_slots, scalings,
                                 p.max_seg_len)
        else:
            self.ops.bgmv_expand(y, buf, lora_b, token_slots, scalings)

    def add_lora(self, x: torch.Tensor, y: torch.Tensor, layer: Any) -> None:
        """One layer's deltas: the kernels' shrink then expand on the layer's slot tensors."""
        buf = self.shrink(x, layer.lora_a, layer.context.token_slots)
        self.expand(y, buf, layer.lora_b, layer.context.token_slots, layer.scalings)

    def clear(self) -> None:
        self.plan = None


class TorchPunica:
    """The engine's default LoRA ops in PyTorch: a few large ops per layer, not a loop.

    :mod:`labkit.lora.ops` (the reference) finds each slot's rows again in every layer and
    runs a matmul per slot present; on a small model on a CPU a step's time is the number of
    ops it launches, which made a mixed batch several times slower than the base model. Here
    every layer runs the same five ops whatever the mix of adapters:

        h = x @ A_all.T              A_all = lora_a viewed [S*r, H_in]: every slot at once
        h *= onehot(slot)            [T, S, r]: a row keeps only its own slot's r columns
        y += (h * scalings) @ B_all  B_all [S*r, H_out]: the row's own B, scaled

    In the engine (:meth:`add_lora`) the five are three, on weights laid out for them once per
    adapter load instead of per step: ``A_all`` is a view of the slots, the layer's
    ``lora_b_packed`` holds every slot's ``B.T`` already scaled (written by ``set_slot``), and
    the mask is widened to ``[T, S*r]`` once per forward, so a layer's delta is
    ``y.addmm_((x @ A_all.T) * mask, B_packed)``: with a few hundred projections per step, on
    a CPU, the number of ops is the cost.

    The one-hot mask is built once per forward (:meth:`prepare`). It costs ``max_loras`` times
    the delta's FLOPs (``S * r`` columns instead of ``r``), small next to the base matmul while
    ``S * r`` is much less than the hidden size; the Triton kernels (:class:`TritonPunica`)
    skip that work instead. Base rows (slot -1) have an all-zero mask: their delta is exactly
    0.0, so ``y`` keeps its bits."""

    def __init__(self) -> None:
        self.plan: _Plan | None = None
        self.onehot: torch.Tensor | None = None
        self.wide: torch.Tensor | None = None  # the mask per column of A_all: [T, S*r]

    def prepare(self, token_slots: torch.Tensor, query_lens: list[int] | None) -> None:
        self.plan = _Plan(token_slots, False)
        self.onehot = self.wide = None  # built at the first layer, which knows S, r, dtype

    def add_lora(self, x: torch.Tensor, y: torch.Tensor, layer: Any) -> None:
        """``y += (x @ A_all.T) * mask @ B_packed`` (see the class doc): three ops."""
        s, r, h_in = layer.lora_a.shape
        wide = self.wide
        if wide is None or wide.shape[1] != s * r or wide.dtype != x.dtype:
            mask = self._mask(layer.context.token_slots, s, x.dtype)
            wide = self.wide = mask.repeat_interleave(r, dim=1)
        h = x @ layer.lora_a.view(s * r, h_in).T
        y.addmm_(h.mul_(wide), layer.lora_b_packed)

    def _mask(self, token_slots: torch.Tensor, num_slots: int, dtype: torch.dtype
              ) -> torch.Tensor:
        if self.plan is None or self.plan.token_slots is not token_slots:
            raise RuntimeError("TorchPunica used without prepare() for this forward's token "
                               "slots (LoRAContext.update_metadata calls it)")
        if self.onehot is None or self.onehot.shape[1] != num_slots:
            hot = torch.nn.functional.one_hot(token_slots.clamp(min=0), num_slots)
            self.onehot = (hot * (token_slots >= 0).unsqueeze(1)).to(dtype)
        return self.onehot

    def shrink(self, x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor
               ) -> torch.Tensor:
        s, r, h_in = lora_a.shape
        mask = self._mask(token_slots, s, x.dtype)
        h = (x @ lora_a.view(s * r, h_in).T).view(-1, s, r)
        return h * mask.unsqueeze(2)

    def expand(self, y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor,
               token_slots: torch.Tensor, scalings: torch.Tensor) -> None:
        s, h_out, r = lora_b.shape
        self._mask(token_slots, s, y.dtype)  # checks the plan
        w = (buf * scalings.view(1, s, 1)).view(-1, s * r)
        y.addmm_(w, lora_b.transpose(1, 2).reshape(s * r, h_out))

    def clear(self) -> None:
        self.plan, self.onehot, self.wide = None, None, None

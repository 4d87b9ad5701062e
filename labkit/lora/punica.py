"""The LoRA ops behind :class:`~labkit.lora.layers.LoRAContext`, planned once per forward (vLLM's
punica wrapper): :class:`TritonPunica` (the Triton kernels) and :class:`TorchPunica` (PyTorch).

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

    def clear(self) -> None:
        self.plan = None


class TorchPunica:
    """The same per-forward plan in PyTorch (the engine's default LoRA ops).

    :mod:`labkit.lora.ops` finds each slot's rows again in every layer (``unique`` and
    ``nonzero`` per call, 2 x 7 projections x layers times a step); on a small model, where a
    step's time is the number of ops it launches, that made a mixed batch several times slower
    than the base model. Here the grouping is worked out once per forward, and each layer pays:

    - a step with prefill chunks: one ``matmul`` per *segment* (a run of one slot, as SGMV),
      on row slices (views: no gather, no scatter), expand as ``addmm_`` into the output;
    - a decode-only step: one batched matmul over rows (BGMV's layout): each row's factor is
      gathered (``lora_a[slot]``: T x r x H, small at decode's T) and ``bmm`` does every row
      at once, whatever mix of adapters. Base rows gather slot 0 and are scaled by 0, adding
      exactly nothing (``y + 0.0 == y``)."""

    def __init__(self) -> None:
        self.plan: _Plan | None = None
        self.segs: list[tuple[slice, int]] = []
        self.idx: torch.Tensor | None = None
        self.keep: torch.Tensor | None = None

    def prepare(self, token_slots: torch.Tensor, query_lens: list[int] | None) -> None:
        sgmv = query_lens is not None and max(query_lens, default=1) > 1
        self.plan = _Plan(token_slots, sgmv)
        if sgmv:
            starts, seg_slots = segments(token_slots.tolist())
            self.segs = [(slice(a, b), s) for a, b, s in zip(starts, starts[1:], seg_slots)
                         if s >= 0]
        else:
            self.idx = token_slots.clamp(min=0)
            self.keep = (token_slots >= 0).unsqueeze(1)

    def _plan_for(self, token_slots: torch.Tensor) -> _Plan:
        plan = self.plan
        if plan is None or plan.token_slots is not token_slots:
            raise RuntimeError("TorchPunica used without prepare() for this forward's token "
                               "slots (LoRAContext.update_metadata calls it)")
        return plan

    def shrink(self, x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor
               ) -> torch.Tensor:
        if not self._plan_for(token_slots).sgmv:
            return torch.bmm(lora_a[self.idx], x.unsqueeze(2)).squeeze(2)
        buf = x.new_zeros(x.shape[0], lora_a.shape[1])
        for rows, s in self.segs:
            torch.matmul(x[rows], lora_a[s].T, out=buf[rows])
        return buf

    def expand(self, y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor,
               token_slots: torch.Tensor, scalings: torch.Tensor) -> None:
        if not self._plan_for(token_slots).sgmv:
            delta = torch.bmm(lora_b[self.idx], buf.unsqueeze(2)).squeeze(2)
            y.addcmul_(delta, torch.where(self.keep, scalings[self.idx].unsqueeze(1), 0.0))
            return
        for rows, s in self.segs:
            y[rows].addmm_(buf[rows], lora_b[s].T, alpha=float(scalings[s]))

    def clear(self) -> None:
        self.plan, self.segs, self.idx, self.keep = None, [], None, None

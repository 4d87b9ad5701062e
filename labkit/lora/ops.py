"""The batched LoRA delta for a batch whose rows belong to different adapters (PyTorch).

Punica's two steps (vLLM ``lora/ops``), for T tokens, each with a slot id (-1 = the base model):

    shrink:  buf[t] = x[t] @ A[slot[t]].T                 [T, H_in] -> [T, r]
    expand:  y[t]  += scaling[slot[t]] * buf[t] @ B[slot[t]].T    [T, r] -> added into [T, H_out]

A slot's rank is padded to the slots' rank r with zeros (rows of A, columns of B), which adds
exactly nothing. Rows of slot -1 are left untouched: base tokens pay no LoRA arithmetic.

This reference loops over the slots present in the step and does one dense matmul per slot
(what SGMV does per segment): a mixed batch of a few adapters costs a few matmuls, not one
gathered ``[T, r, H_in]`` weight copy per token. The Triton versions (``kernels/lora_ops.py``)
keep these signatures, so the layer can call either.
"""

from __future__ import annotations

import torch


def _rows_by_slot(token_slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    """(slot, token indices) for every slot >= 0 present."""
    return [(int(s), (token_slots == s).nonzero().squeeze(1))
            for s in torch.unique(token_slots).tolist() if s >= 0]


def bgmv_shrink(x: torch.Tensor, lora_a: torch.Tensor, token_slots: torch.Tensor
                ) -> torch.Tensor:
    """``x[T, H_in]``, ``lora_a[S, r, H_in]``, ``token_slots[T]`` int64 -> ``[T, r]`` (rows of
    slot -1 are zero)."""
    buf = x.new_zeros(x.shape[0], lora_a.shape[1])
    for s, rows in _rows_by_slot(token_slots):
        buf[rows] = x[rows] @ lora_a[s].T
    return buf


def bgmv_expand(y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor,
                token_slots: torch.Tensor, scalings: torch.Tensor) -> None:
    """Add ``scalings[slot] * buf @ lora_b[slot].T`` into ``y[T, H_out]`` in place, per token
    (``lora_b[S, H_out, r]``, ``scalings[S]``); rows of slot -1 are not touched."""
    for s, rows in _rows_by_slot(token_slots):
        y.index_add_(0, rows, (buf[rows] @ lora_b[s].T) * scalings[s])

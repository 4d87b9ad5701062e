"""The three layers that differ on a tensor-parallel rank; everything else is the plain model.

Column-parallel linears (q/k/v, gate/up) need no new code: a column slice of a linear is a
smaller ``nn.Linear``. Only the layers whose output must be completed across ranks change:
the row-parallel linears (o_proj, down_proj), the vocabulary-parallel embedding and LM head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from labkit.parallel.comm import TPGroup


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_local @ W_local^T) + b: each rank holds a slice of the input features.

    The bias is added once, after the sum (adding it on every rank would count it N times).
    """

    def __init__(self, in_local: int, out_features: int, bias: bool, group: TPGroup,
                 site: str = "") -> None:
        super().__init__(in_local, out_features, bias=bias)
        self.group, self.site = group, site

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(F.linear(x, self.weight), self.site)
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Each rank holds rows [start, stop) of the table; ids outside give zeros; all-reduce sums."""

    def __init__(self, rows: tuple[int, int], per_rank: int, dim: int, group: TPGroup) -> None:
        super().__init__()
        self.start, self.stop = rows
        # padded to per_rank rows so every rank's LM head output has the same width
        self.weight = nn.Parameter(torch.zeros(per_rank, dim))
        self.group = group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        mine = (ids >= self.start) & (ids < self.stop)
        local = torch.where(mine, ids - self.start, torch.zeros_like(ids))
        x = F.embedding(local, self.weight) * mine.unsqueeze(-1).to(self.weight.dtype)
        return self.group.all_reduce(x, "embedding")


class ParallelLMHead(nn.Module):
    """Logits for this rank's vocabulary rows, all-gathered and trimmed to the real vocabulary."""

    def __init__(self, per_rank: int, dim: int, vocab_size: int, group: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(per_rank, dim))
        self.vocab_size = vocab_size
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.group.all_gather_last_dim(F.linear(x, self.weight), "lm_head")
        return logits[..., : self.vocab_size]

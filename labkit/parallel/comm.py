"""The two collectives tensor parallelism needs, counted as they run.

Every call goes through here so a rank can report exactly how many all-reduces and all-gathers
one step made and how many bytes each moved; the tests hold those numbers to the formula
(2 all-reduces per layer + 1 for the embedding, 1 all-gather for the logits) and the trace
records them per step. ``bytes`` is the payload each rank contributes (the tensor's size); what
a ring all-reduce actually puts on the wire is 2(N-1)/N times that (see labkit.sim.parallel).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class CollectiveLog:
    """Counts and payload bytes of the collectives since the last ``reset``."""

    counts: dict[str, int] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    #: (site, kind, bytes) of every call since the last reset, e.g. ("layer 3 mlp", ...)
    calls: list[tuple[str, str, int]] = field(default_factory=list)

    def add(self, kind: str, t: torch.Tensor, site: str = "") -> None:
        n = t.numel() * t.element_size()
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + n
        self.calls.append((site, kind, n))

    def reset(self) -> dict[str, dict[str, int]]:
        """Return {kind: {"count", "bytes"}} and start counting afresh."""
        out = {k: {"count": self.counts[k], "bytes": self.bytes[k]} for k in self.counts}
        self.counts, self.bytes, self.calls = {}, {}, []
        return out


class TPGroup:
    """This process's place in the tensor-parallel group, and its collectives.

    Outside a process group (``distributed=False``, the default for ``world == 1``) the
    collectives are identities (still counted), so a single process runs the exact sharded code
    path. A worker process is always ``distributed``: even at world size 1 its collectives go
    through torch.distributed, which is how one GPU proves the NCCL path.
    """

    def __init__(self, rank: int = 0, world: int = 1, distributed: bool | None = None) -> None:
        self.rank, self.world = rank, world
        self.distributed = world > 1 if distributed is None else distributed
        if world > 1 and not self.distributed:
            raise ValueError("a tensor-parallel group of several ranks needs torch.distributed")
        self.log = CollectiveLog()

    def all_reduce(self, x: torch.Tensor, site: str = "") -> torch.Tensor:
        """Sum ``x`` over ranks, in place."""
        self.log.add("all_reduce", x, site)
        if self.distributed:
            dist.all_reduce(x)
        return x

    def all_gather_last_dim(self, x: torch.Tensor, site: str = "") -> torch.Tensor:
        """Concatenate every rank's ``x`` along the last dimension (rank order)."""
        self.log.add("all_gather", x, site)
        if not self.distributed:
            return x
        parts = [torch.empty_like(x) for _ in range(self.world)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=-1)

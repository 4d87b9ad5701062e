"""The two collectives tensor parallelism needs, counted as they run.

Every call goes through here so a rank can report exactly how many all-reduces and all-gathers
one step made and how many bytes each moved; the tests hold those numbers to the formula
(2 all-reduces per layer + 1 for the embedding, 1 all-gather for the logits) and the trace
records them per step. ``bytes`` is the payload each rank contributes (the tensor's size); what
a ring all-reduce actually puts on the wire is 2(N-1)/N times that (see labkit.sim.parallel).

Expert parallelism adds the all-to-alls (kinds ``all_to_all_*``, :mod:`labkit.parallel.expert`).
Unlike an all-reduce, each rank sends a different amount (it depends on where its tokens'
experts live), so :func:`merge_logs` *sums* those kinds over the ranks, and they also carry
``remote_bytes``: the part of the payload addressed to another rank (the rest is each rank's
chunk for itself, which the all-to-all copies locally).
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
    #: all-to-all kinds only: the bytes addressed to other ranks
    remote: dict[str, int] = field(default_factory=dict)

    def add(self, kind: str, t: torch.Tensor, site: str = "", remote: int | None = None) -> None:
        n = t.numel() * t.element_size()
        self.counts[kind] = self.counts.get(kind, 0) + 1
        self.bytes[kind] = self.bytes.get(kind, 0) + n
        if remote is not None:
            self.remote[kind] = self.remote.get(kind, 0) + remote
        self.calls.append((site, kind, n))

    def reset(self) -> dict[str, dict[str, int]]:
        """Return {kind: {"count", "bytes"[, "remote_bytes"]}} and start counting afresh."""
        out = {k: {"count": self.counts[k], "bytes": self.bytes[k]} for k in self.counts}
        for k, n in self.remote.items():
            out[k]["remote_bytes"] = n
        self.counts, self.bytes, self.calls, self.remote = {}, {}, [], {}
        return out


def merge_logs(logs: list[dict[str, dict[str, int]]]) -> dict[str, dict[str, int]]:
    """One step's collectives from every rank's ``reset()``: the symmetric collectives as rank
    0 counted them (every rank contributes the same payload), the ``all_to_all_*`` kinds summed
    over the ranks (the whole group's payload in that step)."""
    out = {k: dict(v) for k, v in logs[0].items()}
    for log in logs[1:]:
        for kind, v in log.items():
            if not kind.startswith("all_to_all"):
                continue
            have = out.setdefault(kind, {"count": v["count"]})
            for key in ("bytes", "remote_bytes"):
                have[key] = have.get(key, 0) + v.get(key, 0)
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

    def all_to_all(self, x: torch.Tensor, send: list[int], recv: list[int], kind: str,
                   site: str = "") -> torch.Tensor:
        """Rows ``x[sum(send[:d]) : sum(send[:d+1])]`` go to rank d; returns the rows every rank
        sent here, in rank order (``recv[s]`` from rank s). gloo and NCCL both implement the
        uneven ``all_to_all_single``; the payload is ``x``, the remote part all but ``send[rank]``
        rows."""
        row = x[0].numel() * x.element_size() if x.shape[0] else 0  # no rows: none remote
        self.log.add(kind, x, site, remote=(sum(send) - send[self.rank]) * row)
        if not self.distributed:
            return x
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send)
        return out

    def all_gather_rows(self, x: torch.Tensor, rows: list[int], site: str = "") -> torch.Tensor:
        """Concatenate every rank's rows (rank r holds ``rows[r]`` of them) along dim 0. Each rank
        pads to ``max(rows)`` first (collectives move equal shapes), and that padded tensor is
        what is counted."""
        pad = x.new_zeros((max(rows), *x.shape[1:]))
        pad[: x.shape[0]] = x
        self.log.add("all_gather_tokens", pad, site)
        if not self.distributed:
            return x
        parts = [torch.empty_like(pad) for _ in range(self.world)]
        dist.all_gather(parts, pad)
        return torch.cat([p[:n] for p, n in zip(parts, rows)])

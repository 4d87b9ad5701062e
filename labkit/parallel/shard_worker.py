"""What lives in each tensor-parallel process: the rank's shard, and the calls the driver makes.

``ShardFactory`` is the picklable recipe a worker process runs at start (load my slices);
``ShardWorker`` answers the driver's calls. The engine's tensor-parallel executor adds a model
runner around the same shard; these plain calls (a forward, a reference generation) are what the
tests and the notebook use to compare a split model with the whole one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from labkit.model.config import ModelConfig
from labkit.model.generate import generate
from labkit.parallel.comm import TPGroup
from labkit.parallel.plan import make_plan
from labkit.parallel.shard import SafetensorsSource, StateDictSource, build_shard


@dataclass
class ShardFactory:
    """Builds rank r's shard from a checkpoint folder (slices only) or an in-memory state."""

    config: ModelConfig
    folder: str | None = None
    state: dict[str, torch.Tensor] | None = None
    dtype: torch.dtype = torch.float32
    expert_parallel: bool = False

    def __call__(self, group: TPGroup) -> ShardWorker:
        plan = make_plan(self.config, group.world, group.rank, self.expert_parallel)
        source = SafetensorsSource(Path(self.folder)) if self.folder else \
            StateDictSource(self.state or {})
        model = build_shard(self.config, plan, source, group, self.dtype)
        return ShardWorker(model, group)


class ShardWorker:
    def __init__(self, model: torch.nn.Module, group: TPGroup) -> None:
        self.model, self.group = model, group

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits of a plain causal forward (every rank returns the same)."""
        return self.model(input_ids)

    def generate(self, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
        """Greedy reference generation on the split model (contiguous KV cache of local heads)."""
        return generate(self.model, prompt, max_new_tokens)

    def collectives(self) -> dict[str, dict[str, int]]:
        """Collectives since the last call: {kind: {count, bytes}}."""
        return self.group.log.reset()

    def collective_calls(self) -> list[tuple[str, str, int]]:
        """Every collective since the last reset, in order: (site, kind, bytes)."""
        return list(self.group.log.calls)

    def kv_heads(self) -> int:
        return self.model.config.num_key_value_heads

    def fail(self, message: str) -> None:
        """Raise inside the worker (the failure-handling tests use it)."""
        raise RuntimeError(message)

    def wait(self, seconds: float) -> None:
        """Block like a long forward (the interrupt tests use it)."""
        import time

        time.sleep(seconds)

    def crash(self) -> None:
        """Exit the process abruptly, as a segfault or OOM kill would."""
        import os

        os._exit(3)

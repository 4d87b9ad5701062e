"""The tensor-parallel executor: the engine's executor contract, run on N worker processes.

The driver keeps everything that decides: the scheduler, the block manager and its block
tables, sampling and the per-request generators. Each step it sends every rank the same packed
chunks (block tables, positions, token ids: a few lists, no tensors) and applies the same block
copies to every rank's KV cache; each rank runs its shard through an ordinary ``ModelRunner``
over its own ``PagedKVCache`` (its heads only), the collectives inside the forward meet, and rank
0 returns the full-vocabulary logits. So the driver-side code is ``ModelExecutor``'s, unchanged:
only the runner it talks to lives in other processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from labkit.config import CacheConfig, EngineConfig
from labkit.engine.executor import ModelRunnerOutput
from labkit.engine.model_runner import Chunk, ModelExecutor, ModelRunner
from labkit.kv.attention import get_attention_backend
from labkit.kv.block_manager import BlockOps
from labkit.model.config import ModelConfig
from labkit.model.loader import CheckpointHandle
from labkit.model.moe import use_fused_experts
from labkit.parallel.comm import TPGroup, merge_logs
from labkit.parallel.launch import LaunchedGroup
from labkit.parallel.plan import TensorParallelError, make_plan
from labkit.parallel.shard import SafetensorsSource, StateDictSource, build_shard
from labkit.parallel.workers import WorkerGroup
from labkit.sched.scheduler import SchedulerOutput


@dataclass
class RankRecipe:
    """What a worker process builds at start (picklable: sent once, at spawn)."""

    config: ModelConfig
    cache: CacheConfig
    attention_backend: str | None
    dtype: torch.dtype = torch.float32
    folder: str | None = None                       # load my slices from here ...
    state: dict[str, torch.Tensor] | None = field(default=None, repr=False)  # ... or from this
    device: str = "cpu"                             # "cuda": rank r on GPU r (NCCL)
    expert_parallel: bool = False                   # place MoE experts (labkit.parallel.expert)

    def __call__(self, group: TPGroup) -> RankWorker:
        plan = make_plan(self.config, group.world, group.rank, self.expert_parallel)
        source = SafetensorsSource(Path(self.folder)) if self.folder else \
            StateDictSource(self.state or {})
        # the GPU the worker set before joining: rank r (spawned) or LOCAL_RANK (torchrun)
        device = f"cuda:{torch.cuda.current_device()}" if self.device == "cuda" else self.device
        model = build_shard(self.config, plan, source, group, self.dtype, device)
        if self.attention_backend == "triton" and plan.experts_per_rank:
            from labkit.kernels.fused_moe import fused_moe  # as the engine does in-process

            use_fused_experts(model, fused_moe)
        backend = get_attention_backend(self.attention_backend)
        c = self.cache
        runner = ModelRunner.for_model(model, c.block_size, c.num_blocks, c.num_cpu_blocks,
                                       backend, c.kv_cache_dtype)
        return RankWorker(runner, group)


class RankWorker:
    """One rank: its runner, answering the driver's calls."""

    def __init__(self, runner: ModelRunner, group: TPGroup) -> None:
        self.runner, self.group = runner, group

    def forward(self, chunks: list[Chunk], rows: list[list[int]]) -> Any:
        logits = self.runner.forward(chunks, rows)
        calls = list(self.group.log.calls)
        log = self.group.log.reset()
        if self.group.rank:
            # every rank holds the same logits: one copy is enough; the log differs for the
            # expert-parallel all-to-alls (each rank sends what its tokens routed)
            return None, log, None
        return logits.cpu(), log, calls  # the driver samples on the CPU (no CUDA IPC)

    def apply_block_ops(self, ops: BlockOps) -> None:
        kv = self.runner.kv_cache
        kv.swap_out(ops.swap_out)
        kv.swap_in(ops.swap_in)
        kv.copy_blocks(ops.copies)

    def kv_heads(self) -> int:
        return self.runner.kv_cache.k_caches[0].shape[2]

    def describe(self) -> dict[str, Any]:
        """Where this rank runs: its collective backend and device (the GPU check records it)."""
        return {"rank": self.group.rank, "world": self.group.world,
                "backend": dist.get_backend() if dist.is_initialized() else None,
                "device": str(self.runner.device), "kv_heads": self.kv_heads()}

    def fail(self, message: str) -> None:
        raise RuntimeError(message)  # the failure tests use it


class TPRunner:
    """``ModelRunner``'s interface, executed on N ranks; sampling stays in the driver."""

    sample = staticmethod(ModelRunner.sample)

    def __init__(self, workers: WorkerGroup | LaunchedGroup, model: CheckpointHandle,
                 block_size: int) -> None:
        self.workers, self.model, self.block_size = workers, model, block_size
        self.device = torch.device("cpu")  # where the logits arrive and sampling runs
        self.last_collectives: dict[str, dict[str, int]] = {}
        #: (site, kind, bytes) of each collective of the last forward, in order
        self.last_calls: list[tuple[str, str, int]] = []

    def forward(self, chunks: list[Chunk], rows: list[list[int]],
                owners: Any = None) -> torch.Tensor:
        """``owners`` (the chunks' sequences, for ``ModelRunner.step_hooks``) stay here: the
        ranks' runners have no step hooks (LoRA refuses tensor parallelism in this version)."""
        answers = self.workers.call("forward", chunks, rows)
        logits, _, self.last_calls = answers[0]
        self.last_collectives = merge_logs([log for _, log, _ in answers])
        return logits


class TPExecutor(ModelExecutor):
    """``ModelExecutor`` over a ``TPRunner``; block copies go to every rank in one call."""

    def __init__(self, runner: TPRunner) -> None:
        super().__init__(runner)  # type: ignore[arg-type]
        self.collectives: list[dict[str, dict[str, int]]] = []  # one entry per forward

    def apply_block_ops(self, ops: BlockOps) -> None:
        if ops.copies or ops.swap_out or ops.swap_in:
            self.runner.workers.call("apply_block_ops", ops)

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        result = super().execute(scheduler_output)
        result.collectives = self.runner.last_collectives
        self.runner.last_collectives = {}
        return result

    def shutdown(self) -> None:
        self.runner.workers.shutdown()


def distributed_backend(device: torch.device | str, world: int, local: bool = True) -> str:
    """"gloo" for CPU ranks, "nccl" for GPU ranks (rank r on GPU r: there must be ``world``,
    unless the ranks are not all ``local``: torchrun places them, a node's LOCAL_RANK each)."""
    kind = torch.device(device).type
    if kind == "cpu":
        return "gloo"
    if kind != "cuda":
        raise TensorParallelError(f"tensor parallelism runs on cpu (gloo) or cuda (NCCL), "
                                  f"not {kind}")
    if local and torch.cuda.device_count() < world:
        raise TensorParallelError(f"tensor_parallel_size {world} needs {world} GPUs (rank r "
                                  f"on GPU r); this machine has {torch.cuda.device_count()}")
    return "nccl"


def build_tp_executor(model: Any, config: EngineConfig) -> TPExecutor:
    """The registered ``"tensor_parallel"`` executor factory: ``model`` is a
    ``CheckpointHandle`` (each rank reads only its slices of the folder) or a loaded model (its
    tensors are sent to the ranks, which keep their slices). The model's device picks the
    backend: gloo on CPU, NCCL on CUDA. ``enable_expert_parallel`` places an MoE model's
    experts on the ranks (:mod:`labkit.parallel.expert`)."""
    world, ep = config.parallel.tensor_parallel_size, config.parallel.enable_expert_parallel
    make_plan(model.config, world, 0, ep)  # fail here, with the count to fix, before spawning
    launched = config.parallel.distributed_executor_backend == "external_launcher"
    backend = distributed_backend(model.device, world, local=not launched)
    recipe = RankRecipe(model.config, config.cache, config.model.attention_backend, model.dtype,
                        device=model.device.type, expert_parallel=ep)
    if isinstance(model, CheckpointHandle):
        recipe.folder = str(model.folder)
    else:  # pickled through the pipe: CPU copies (a CUDA tensor would need IPC handles)
        recipe.state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    handle = CheckpointHandle(model.config, Path(), model.dtype)
    workers = LaunchedGroup(world, recipe, backend=backend) if launched else \
        WorkerGroup(world, recipe, backend=backend)
    return TPExecutor(TPRunner(workers, handle, config.cache.block_size))

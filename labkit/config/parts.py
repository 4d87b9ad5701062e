"""The parts every engine has: what it serves, its KV pool, its scheduler, its devices.

Each is read by the layer it configures and checked in ``__post_init__`` (see :mod:`labkit.config`).
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.errors import EngineConfigError
from labkit.utils import check_int

POLICIES = ("fcfs", "priority", "sjf", "fair")
PREEMPTION_MODES = ("recompute", "swap")
BATCHING = ("continuous", "static")
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
ATTENTION_BACKENDS = ("torch", "triton")
SPEC_METHODS = ("draft_model", "ngram", "eagle")
KV_ROLES = ("kv_producer", "kv_consumer", "kv_both")


@dataclass
class ModelSettings:
    """What is served. ``max_model_len=None`` means the model's own context
    (``max_position_embeddings``); it may be shorter, never longer (positions past the model's
    context would fail inside the forward, mid-batch)."""

    max_model_len: int | None = None
    max_position_embeddings: int | None = None
    vocab_size: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    name: str = ""
    attention_backend: str | None = None  # "torch" (reference) | "triton"; None = torch

    def __post_init__(self) -> None:
        self.eos_token_ids = tuple(self.eos_token_ids)
        limit = self.max_position_embeddings
        if self.max_model_len is None:
            if limit is None:
                raise EngineConfigError("max_model_len is needed (no model context to take)")
            self.max_model_len = limit
        check_int("max_model_len", self.max_model_len, 2)
        if limit is not None and self.max_model_len > limit:
            raise EngineConfigError(f"max_model_len={self.max_model_len} exceeds the model's "
                                    f"context (max_position_embeddings={limit}); lower it or "
                                    "leave it unset")
        if self.attention_backend not in (None, *ATTENTION_BACKENDS):
            raise EngineConfigError(f"unknown attention backend {self.attention_backend!r}; "
                                    "choose 'torch' or 'triton'")


@dataclass
class CacheConfig:
    """The paged KV pool. ``num_blocks=None``: sized by the engine builder from
    ``kv_cache_bytes`` and the bytes one block takes (:meth:`resolve_num_blocks`)."""

    block_size: int = 16
    num_blocks: int | None = None
    num_cpu_blocks: int = 0
    enable_prefix_caching: bool = True
    kv_cache_dtype: str = "auto"
    kv_cache_bytes: int | None = None
    bytes_per_block: int | None = None  # set with num_blocks by the builder (stats, trace)
    # one block table per layer group for models mixing sliding and full layers
    # (labkit.kv.hybrid_manager); True keeps one table, as vLLM's flag of the same name
    disable_hybrid_kv_cache_manager: bool = False
    # each group's sliding window (None: full), set by the builder when it gives the groups
    # their own tables: what one request can hold at most (engine.validate.check_fits)
    kv_group_windows: tuple[int | None, ...] | None = None

    def __post_init__(self) -> None:
        check_int("block_size", self.block_size)
        if self.num_blocks is not None:
            check_int("num_blocks", self.num_blocks)
        check_int("num_cpu_blocks", self.num_cpu_blocks, 0)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise EngineConfigError(f"kv_cache_dtype={self.kv_cache_dtype!r}; choose 'auto' (the "
                                    "model's dtype), 'int8' or 'fp8' (e4m3; both with "
                                    "per-token, per-head scales)")

    def resolve_num_blocks(self, bytes_per_block: int, max_num_seqs: int, max_model_len: int,
                           default_cap: int = 256 << 20) -> int:
        """Pool size: ``num_blocks`` if given, else ``kv_cache_bytes // bytes_per_block``, else
        (no budget) enough for max_num_seqs full-length sequences, capped at ``default_cap``
        bytes. A smaller block (an INT8 cache) turns the same bytes into more blocks."""
        self.bytes_per_block = bytes_per_block
        if self.num_blocks is not None:
            return self.num_blocks
        if self.kv_cache_bytes is None:
            want = -(-max_num_seqs * max_model_len // self.block_size)
            self.num_blocks = max(1, min(want, default_cap // bytes_per_block))
        else:
            self.num_blocks = int(self.kv_cache_bytes // bytes_per_block)
            if self.num_blocks < 1:
                raise EngineConfigError(f"kv_cache_bytes={self.kv_cache_bytes} holds no block "
                                        f"of {bytes_per_block} bytes; raise it")
        return self.num_blocks


@dataclass
class SchedulerConfig:
    """How each step's batch is chosen (see :mod:`labkit.sched.scheduler`).
    ``max_num_batched_tokens=None``: 512 with chunked prefill, else the model's context."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = 512
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"
    batching: str = "continuous"
    preemption_mode: str = "recompute"
    watermark_high: float = 1.0
    watermark_low: float = 1.0
    num_lookahead_slots: int = 0  # extra KV slots per decoding sequence (speculative decoding)
    tenant_weights: dict[str, float] | None = None  # policy "fair": tenant -> share (default 1)
    # per-tenant quotas, any policy (labkit.sched.quota): running sequences, KV blocks held
    tenant_max_running: int | None = None
    tenant_max_kv_blocks: int | None = None
    # vLLM's --async-scheduling: schedule step N+1 while step N's forward runs
    # (labkit.engine.overlap); checked against the other parts in EngineConfig
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs)
        if not isinstance(self.async_scheduling, bool):
            raise EngineConfigError(f"async_scheduling must be True or False, got "
                                    f"{self.async_scheduling!r}")
        if self.max_num_batched_tokens is not None:
            check_int("max_num_batched_tokens", self.max_num_batched_tokens)
        check_int("num_lookahead_slots", self.num_lookahead_slots, 0)
        for name in ("tenant_max_running", "tenant_max_kv_blocks"):
            if getattr(self, name) is not None:
                check_int(name, getattr(self, name))
        for name, value, choices in (("policy", self.policy, POLICIES),
                                     ("preemption_mode", self.preemption_mode, PREEMPTION_MODES),
                                     ("batching", self.batching, BATCHING)):
            if value not in choices:
                raise EngineConfigError(f"unknown {name} {value!r}; choose one of {choices}")
        if not 0.0 < self.watermark_low <= self.watermark_high <= 1.0:
            raise EngineConfigError("need 0 < watermark_low <= watermark_high <= 1, got "
                                    f"{self.watermark_low}, {self.watermark_high}")
        self._check_tenant_weights()

    def _check_tenant_weights(self) -> None:
        w = self.tenant_weights
        if w is None:
            return
        if self.policy != "fair":
            raise EngineConfigError(f"tenant_weights only apply to policy='fair' (got policy="
                                    f"{self.policy!r}); set policy='fair' or drop the weights")
        if not isinstance(w, dict) or not w:
            raise EngineConfigError(f"tenant_weights must be a non-empty dict tenant -> weight, "
                                    f"got {w!r}")
        for t, v in w.items():
            if not isinstance(t, str) or isinstance(v, bool) or \
                    not isinstance(v, (int, float)) or not 0 < v < float("inf"):
                raise EngineConfigError(f"tenant_weights[{t!r}] = {v!r}: a tenant name (str) "
                                        "needs a finite weight > 0")
        self.tenant_weights = {t: float(v) for t, v in w.items()}


@dataclass
class ParallelConfig:
    """Devices sharing the model: ``tensor_parallel_size`` worker processes each hold a shard
    (labkit.parallel); whether the model's head counts divide is checked against the model
    when the executor is built. ``distributed_executor_backend="mp"`` (vLLM's name) runs the
    model in worker processes even at size 1: one GPU proves the NCCL path that way.
    ``"external_launcher"`` (vLLM's name too) means torchrun started the ranks, possibly on
    several machines: this process is rank 0 and the others wait in
    ``labkit.parallel.launch.worker_loop``.

    ``enable_expert_parallel`` (vLLM's flag) places each MoE layer's experts on the same ranks
    instead (rank r holds experts ``r*E/N .. (r+1)*E/N - 1`` whole) and moves tokens to them
    with all-to-all (:mod:`labkit.parallel.expert`); attention stays tensor parallel. In one
    process (size 1, no "mp") there is nothing to place and the flag changes nothing."""

    tensor_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: "mp" when size > 1, else in-process
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        check_int("tensor_parallel_size", self.tensor_parallel_size)
        if not isinstance(self.enable_expert_parallel, bool):
            raise EngineConfigError(f"enable_expert_parallel must be True or False, got "
                                    f"{self.enable_expert_parallel!r}")
        if self.distributed_executor_backend not in (None, "mp", "external_launcher"):
            raise EngineConfigError(f"distributed_executor_backend must be None, 'mp' or "
                                    f"'external_launcher', got "
                                    f"{self.distributed_executor_backend!r}")

    @property
    def uses_workers(self) -> bool:
        """Whether the model runs in worker processes (labkit.parallel) or in this one."""
        return self.tensor_parallel_size > 1 or self.distributed_executor_backend is not None

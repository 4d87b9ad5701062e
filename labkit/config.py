"""EngineConfig: every engine setting in one place, checked once (vLLM's ``vllm.config``).

One object, five parts, each read by the layer it configures:

- ``model`` (:class:`ModelSettings`): what the engine serves -- context length, vocabulary,
  EOS ids, the attention backend. (vLLM calls it ``ModelConfig``; here that name is the
  architecture in :mod:`labkit.model.config`.)
- ``cache`` (:class:`CacheConfig`): the paged KV pool -- block size, GPU / CPU blocks, prefix
  caching, the KV dtype. Read by the block manager and the KV tensors.
- ``scheduler`` (:class:`SchedulerConfig`): batch limits, chunked prefill, policy, preemption,
  watermarks, lookahead slots. Read by the scheduler.
- ``speculative`` (:class:`SpeculativeConfig` or None): drafts per step and where they come from.
- ``parallel`` (:class:`ParallelConfig`): how many devices share the model (1 today).
- ``lora`` (:class:`LoRAConfig` or None): multi-LoRA adapter slots (``enable_lora=True``).
- ``kv_transfer`` (:class:`KVTransferConfig` or None): a KV connector that moves blocks in and
  out of the engine (vLLM's ``kv_transfer_config``; :mod:`labkit.kv.connector`).

Why one object checked in ``__post_init__``: a value that is only wrong deep inside ``step()``
fails a whole batch of other users' requests; here it fails at construction, with what to
change. Cross-part settings are resolved here too, *before* anything is built: the speculative
γ becomes the scheduler's ``num_lookahead_slots``, the token budget's default follows chunked
prefill. The trace's ``meta`` is derived from this object (:meth:`EngineConfig.trace_meta`).

This module sits at the bottom of the layers (beside errors and utils): it imports no torch and
no other labkit package, so every layer can read its part.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from labkit.errors import EngineConfigError, SpeculativeConfigError
from labkit.utils import check_int, is_int

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

    def __post_init__(self) -> None:
        check_int("max_num_seqs", self.max_num_seqs)
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
class SpeculativeConfig:
    """vLLM's ``speculative_config``: ``{"method": "draft_model" | "ngram" | "eagle", "model":
    "labkit-tiny-draft-distilled", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
    "prompt_lookup_min": 1}``. ``draft_model`` is the loaded draft (set by the engine builder,
    which checks it against the target with :meth:`check_draft`)."""

    method: str
    num_speculative_tokens: int = 4
    model: Any = None  # draft: shipped name, local path, or an nn.Module (tests)
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 1
    draft_model: Any = None

    def __post_init__(self) -> None:
        g = self.num_speculative_tokens
        if not is_int(g) or g < 1:
            raise SpeculativeConfigError(
                f"num_speculative_tokens (γ) must be an integer >= 1, got {g!r}")
        if self.method not in SPEC_METHODS:
            raise SpeculativeConfigError(
                f"unknown speculative method {self.method!r}; choose one of {SPEC_METHODS}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if self.method == "ngram" and (not (is_int(lo) and is_int(hi)) or not 1 <= lo <= hi):
            raise SpeculativeConfigError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}")
        if self.method == "eagle" and self.model is None:
            raise SpeculativeConfigError(
                'method "eagle" needs "model": an EAGLE head trained for the target, such as '
                '"labkit-tiny-eagle", a head folder, or an EagleDraft object')
        if self.method == "draft_model" and self.model is None:
            raise SpeculativeConfigError(
                'method "draft_model" needs "model": a shipped name such as '
                '"labkit-tiny-draft", a checkpoint folder, or a model object')

    @classmethod
    def from_dict(cls, d: dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        if isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise SpeculativeConfigError(f"speculative_config must be a dict, got {type(d)}")
        known = {f.name for f in fields(cls)} - {"draft_model"}
        unknown = set(d) - known
        if unknown:
            raise SpeculativeConfigError(f"unknown speculative_config keys {sorted(unknown)}; "
                                         f"valid keys: {sorted(known)}")
        d = dict(d)
        if d.get("method") is None:  # vLLM infers the method from what is given
            d["method"] = "draft_model" if d.get("model") is not None else "ngram"
        return cls(**d)

    @staticmethod
    def check_draft(draft: Any, target: Any, max_model_len: int) -> None:
        """A draft with another vocabulary proposes ids that mean something else to the target;
        one with a shorter context would crash on a long prompt: both fail here, up front."""
        if draft.vocab_size != target.vocab_size:
            raise SpeculativeConfigError(
                f"draft vocabulary ({draft.vocab_size} tokens) differs from the target's "
                f"({target.vocab_size}): draft and target must share one tokenizer")
        if draft.max_position_embeddings < max_model_len:
            raise SpeculativeConfigError(
                f"draft context ({draft.max_position_embeddings} positions) is smaller than the "
                f"target's ({max_model_len}, max_model_len): the draft could not propose for "
                "long sequences; use a draft with at least that context or lower max_model_len")


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


@dataclass
class LoRAConfig:
    """vLLM's ``LoRAConfig`` (``LLM(..., enable_lora=True, max_loras=4, max_lora_rank=16,
    max_cpu_loras=8)``): at most ``max_loras`` adapters sit in the device slots at once (so one
    step mixes at most that many), up to ``max_cpu_loras`` loaded adapters wait in a CPU cache
    (LRU, :mod:`labkit.lora.manager`), and no adapter may have a rank above ``max_lora_rank``
    (the slots are allocated at that rank). ``max_cpu_loras=None`` means ``max_loras``."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        check_int("max_loras", self.max_loras)
        check_int("max_lora_rank", self.max_lora_rank)
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        check_int("max_cpu_loras", self.max_cpu_loras)
        if self.max_cpu_loras < self.max_loras:
            raise EngineConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras "
                                    f"({self.max_loras}), as vLLM asks: every adapter in a "
                                    "device slot is also in the CPU cache")

    @classmethod
    def from_kwargs(cls, enable_lora: bool, kw: dict[str, Any]) -> LoRAConfig | None:
        """Pop the LoRA settings out of ``kw``; None unless ``enable_lora``."""
        given = {k: kw.pop(k) for k in ("max_loras", "max_lora_rank", "max_cpu_loras")
                 if k in kw}
        if not enable_lora:
            if given:
                raise EngineConfigError(f"{sorted(given)} only apply with enable_lora=True")
            return None
        return cls(**given)


@dataclass
class KVTransferConfig:
    """vLLM's ``kv_transfer_config``: ``{"kv_connector": "offloading", "kv_role": "kv_both",
    "kv_connector_extra_config": {"cpu_bytes": 1 << 30, "disk_dir": "/tmp/kv",
    "disk_bytes": 8 << 30}}``. ``kv_connector`` is a registered name or a connector object
    (:mod:`labkit.kv.connector`, which builds and checks it); ``kv_role`` says whether this
    instance saves KV (producer), loads it (consumer) or both; the extra config is the
    connector's own settings. Only the shape is checked here: this module imports nothing."""

    kv_connector: Any = None
    kv_role: str = "kv_both"
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector is None:
            raise EngineConfigError('kv_transfer_config needs "kv_connector": a registered name '
                                    'such as "offloading", or a connector object')
        if self.kv_role not in KV_ROLES:
            raise EngineConfigError(f"unknown kv_role {self.kv_role!r}; choose one of {KV_ROLES}")
        if not isinstance(self.kv_connector_extra_config, dict):
            raise EngineConfigError(f"kv_connector_extra_config must be a dict, got "
                                    f"{type(self.kv_connector_extra_config).__name__}")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | KVTransferConfig) -> KVTransferConfig:
        if isinstance(d, KVTransferConfig):
            return d
        if not isinstance(d, dict):
            raise EngineConfigError(f"kv_transfer_config must be a dict, got {type(d).__name__}")
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise EngineConfigError(f"unknown kv_transfer_config keys {sorted(unknown)}; valid: "
                                    f"{sorted(f.name for f in fields(cls))}")
        return cls(**d)


_PARTS = {"model": ModelSettings, "cache": CacheConfig, "scheduler": SchedulerConfig,
          "parallel": ParallelConfig}


@dataclass
class EngineConfig:
    model: ModelSettings
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    lora: LoRAConfig | None = None
    kv_transfer: KVTransferConfig | None = None

    def __post_init__(self) -> None:
        sched, cache = self.scheduler, self.cache
        if sched.max_num_batched_tokens is None:
            sched.max_num_batched_tokens = (512 if sched.enable_chunked_prefill
                                            else self.model.max_model_len)
        if sched.preemption_mode == "swap" and cache.num_cpu_blocks < 1:
            raise EngineConfigError("preemption_mode='swap' needs num_cpu_blocks >= 1 "
                                    "(the CPU pool)")
        if self.speculative is not None:  # resolved before any scheduler exists
            sched.num_lookahead_slots = self.speculative.num_speculative_tokens
        if self.lora is not None and self.parallel.uses_workers:
            raise EngineConfigError("enable_lora works with the single-process model executor "
                                    "in this version: drop tensor parallelism, or run without "
                                    "LoRA")
        if self.kv_transfer is not None and (self.speculative is not None or self.lora
                                             is not None or self.parallel.uses_workers):
            raise EngineConfigError("a KV connector runs with the plain in-process model "
                                    "executor only: drop speculative_config / tensor "
                                    "parallelism / LoRA, or the kv_transfer_config")

    @classmethod
    def from_kwargs(cls, *, speculative_config: Any = None, enable_lora: bool = False,
                    kv_transfer_config: Any = None, kv_connector: Any = None,
                    **kw: Any) -> EngineConfig:
        """The flat keyword arguments of ``LLM(...)`` / ``LLMEngine.from_model(...)``, sorted
        into the parts by field name (``block_size`` -> cache, ``policy`` -> scheduler, ...).
        ``kv_connector=obj`` is short for ``kv_transfer_config={"kv_connector": obj}``."""
        lora = LoRAConfig.from_kwargs(enable_lora, kw)
        parts: dict[str, dict[str, Any]] = {name: {} for name in _PARTS}
        owner = {f.name: name for name, klass in _PARTS.items() for f in fields(klass)}
        for key, value in kw.items():
            if key not in owner:
                raise TypeError(f"unknown engine setting {key!r}; valid: {sorted(owner)}")
            parts[owner[key]][key] = value
        if "max_num_batched_tokens" not in parts["scheduler"]:
            parts["scheduler"]["max_num_batched_tokens"] = None  # default depends on chunking
        spec = (None if speculative_config is None
                else SpeculativeConfig.from_dict(speculative_config))
        if kv_connector is not None:
            if kv_transfer_config is not None:
                raise EngineConfigError("give kv_connector or kv_transfer_config, not both")
            kv_transfer_config = {"kv_connector": kv_connector}
        kvt = (None if kv_transfer_config is None
               else KVTransferConfig.from_dict(kv_transfer_config))
        return cls(**{name: _PARTS[name](**args) for name, args in parts.items()},
                   speculative=spec, lora=lora, kv_transfer=kvt)

    @property
    def max_model_len(self) -> int:
        return int(self.model.max_model_len)

    def trace_meta(self, executor: str) -> dict[str, Any]:
        """The trace's ``meta`` (its schema is fixed: widgets replay it)."""
        c, s = self.cache, self.scheduler
        return {"block_size": c.block_size, "num_blocks": c.num_blocks,
                "num_cpu_blocks": c.num_cpu_blocks, "executor": executor,
                "model": self.model.name, "policy": s.policy, "max_num_seqs": s.max_num_seqs,
                "max_num_batched_tokens": s.max_num_batched_tokens, "batching": s.batching,
                "enable_prefix_caching": c.enable_prefix_caching,
                "enable_chunked_prefill": s.enable_chunked_prefill,
                "preemption_mode": s.preemption_mode, "watermark_low": s.watermark_low,
                "watermark_high": s.watermark_high}

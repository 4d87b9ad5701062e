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

The always-present parts are in :mod:`labkit.config.parts`, the optional ones in
:mod:`labkit.config.optional` (vLLM too keeps one file per config under ``vllm/config/``).

This package sits at the bottom of the layers (beside errors and utils): it imports no torch and
no other labkit package, so every layer can read its part.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from labkit.config.optional import KVTransferConfig, LoRAConfig, SpeculativeConfig
from labkit.config.parts import (
    ATTENTION_BACKENDS,
    BATCHING,
    KV_CACHE_DTYPES,
    KV_ROLES,
    POLICIES,
    PREEMPTION_MODES,
    SPEC_METHODS,
    CacheConfig,
    ModelSettings,
    ParallelConfig,
    SchedulerConfig,
)
from labkit.errors import AsyncSchedulingError, EngineConfigError

__all__ = ["ATTENTION_BACKENDS", "BATCHING", "KV_CACHE_DTYPES", "KV_ROLES", "POLICIES",
           "PREEMPTION_MODES", "SPEC_METHODS", "CacheConfig", "EngineConfig",
           "KVTransferConfig", "LoRAConfig", "ModelSettings", "ParallelConfig",
           "SchedulerConfig", "SpeculativeConfig"]


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
        self._check_async_scheduling()

    def _check_async_scheduling(self) -> None:
        """async_scheduling prepares step N+1 assuming every sequence of step N gets exactly
        one token, in this process, around the plain model executor's forward: a speculative
        step's token count is unknown until verified, LoRA and KV connectors keep per-step
        state of their own around the forward, and worker processes pack their own inputs."""
        if not self.scheduler.async_scheduling:
            return
        other = [name for name, on in (
            ("speculative_config", self.speculative is not None),
            ("enable_lora", self.lora is not None),
            ("tensor parallelism / external_launcher", self.parallel.uses_workers),
            ("kv_transfer_config", self.kv_transfer is not None)) if on]
        if other:
            raise AsyncSchedulingError(
                f"async_scheduling=True cannot be combined with {', '.join(other)} in this "
                "version (it assumes one token per sequence per step from the in-process "
                "model executor): drop one of them")

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

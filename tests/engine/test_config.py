"""EngineConfig: one object, checked once, read by every layer; the executor contract."""

from __future__ import annotations

import pytest

from labkit.config import (
    CacheConfig,
    EngineConfig,
    ModelSettings,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)
from labkit.engine.executor import Executor, ModelRunnerOutput
from labkit.engine.llm_engine import LLMEngine
from labkit.engine.model_runner import ModelExecutor
from labkit.errors import EngineConfigError, SpeculativeConfigError
from labkit.sim.executor import SimExecutor
from labkit.spec.executor import SpecDecodeExecutor


def test_flat_settings_are_sorted_into_their_parts():
    c = EngineConfig.from_kwargs(max_model_len=64, block_size=4, num_blocks=10, policy="sjf",
                                 max_num_seqs=3, tensor_parallel_size=1, name="m")
    assert (c.cache.block_size, c.cache.num_blocks, c.scheduler.policy) == (4, 10, "sjf")
    assert (c.scheduler.max_num_seqs, c.model.name, c.parallel.tensor_parallel_size) == (3, "m", 1)
    assert c.scheduler.max_num_batched_tokens == 512  # chunked prefill's default budget
    c = EngineConfig.from_kwargs(max_model_len=64, enable_chunked_prefill=False)
    assert c.scheduler.max_num_batched_tokens == 64  # without chunking: one whole prompt
    with pytest.raises(TypeError, match="unknown engine setting 'blocksize'"):
        EngineConfig.from_kwargs(max_model_len=64, blocksize=4)


@pytest.mark.parametrize("make,match", [
    (lambda: ParallelConfig(tensor_parallel_size=1.5), "tensor_parallel_size"),
    (lambda: ParallelConfig(tensor_parallel_size=0), "tensor_parallel_size"),
    (lambda: ModelSettings(max_model_len=300, max_position_embeddings=256), "exceeds"),
    (lambda: ModelSettings(), "max_model_len is needed"),
    (lambda: ModelSettings(max_model_len=8, attention_backend="cuda"), "backend"),
    (lambda: CacheConfig(block_size=0), "block_size"),
    (lambda: CacheConfig(kv_cache_dtype="fp8_e5m2"), "kv_cache_dtype"),
    (lambda: SchedulerConfig(policy="lifo"), "policy"),
    (lambda: SchedulerConfig(watermark_low=0.9, watermark_high=0.5), "watermark"),
    (lambda: EngineConfig(ModelSettings(8), scheduler=SchedulerConfig(preemption_mode="swap")),
     "num_cpu_blocks"),
])
def test_each_part_checks_itself_at_construction(make, match):
    with pytest.raises(EngineConfigError, match=match):
        make()


def test_tensor_parallel_sizes_that_do_not_divide_fail_before_spawning(tiny_model):
    with pytest.raises(EngineConfigError, match="not divisible by tensor_parallel_size 3"):
        LLMEngine.from_model(tiny_model, tensor_parallel_size=3)


def test_speculative_settings_resolve_before_the_scheduler_exists(tiny_model):
    """γ becomes the scheduler's lookahead in the config itself: the scheduler the engine
    builds reads it from there, nobody changes it afterwards."""
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    c = EngineConfig(ModelSettings(64), speculative=spec)
    assert c.scheduler.num_lookahead_slots == 3
    eng = LLMEngine.from_model(tiny_model, block_size=4, num_blocks=32,
                               speculative_config={"method": "ngram",
                                                   "num_speculative_tokens": 3})
    assert eng.scheduler.config is eng.config.scheduler
    assert eng.scheduler.config.num_lookahead_slots == 3
    assert isinstance(eng.executor, SpecDecodeExecutor)
    with pytest.raises(SpeculativeConfigError):  # a subclass of EngineConfigError
        SpeculativeConfig("ngram", 0)
    assert issubclass(SpeculativeConfigError, EngineConfigError)


def test_trace_meta_is_derived_from_the_config(tiny_model):
    eng = LLMEngine.from_model(tiny_model, block_size=4, kv_cache_bytes=1 << 16, policy="sjf",
                               watermark_high=0.9, watermark_low=0.5)
    c = eng.config
    assert eng.trace.meta == c.trace_meta("model")
    assert (eng.trace.meta["num_blocks"], eng.trace.meta["policy"]) == (c.cache.num_blocks, "sjf")
    assert c.cache.num_blocks == (1 << 16) // c.cache.bytes_per_block  # resolved from the bytes
    assert eng.block_manager.num_blocks == c.cache.num_blocks
    assert eng.executor.kv_cache.k_caches[0].shape[0] == c.cache.num_blocks


def test_every_executor_implements_the_contract():
    for cls in (ModelExecutor, SpecDecodeExecutor, SimExecutor):
        assert issubclass(cls, Executor)
        assert not hasattr(cls, "kind") and not hasattr(cls, "pop_spec_records")
    assert (ModelExecutor.name, SimExecutor.name, SimExecutor.real_tokens) == ("model", "sim",
                                                                              False)

    class Incomplete(Executor):
        def execute(self, scheduler_output):
            return ModelRunnerOutput()

    with pytest.raises(TypeError, match="apply_block_ops"):
        Incomplete()


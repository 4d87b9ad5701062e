"""``LLM(..., tensor_parallel_size=2)`` through the real engine: same greedy tokens as the
unsplit reference, with prefix caching, chunked prefill and preemption; collectives counted
exactly; failures and shutdown leave no process behind."""

from __future__ import annotations

import gc

import pytest
import torch

from labkit import LLM, SamplingParams
from labkit.engine.invariants import assert_no_leaks
from labkit.model.generate import generate
from labkit.model.loader import CheckpointHandle
from labkit.parallel.plan import TensorParallelError
from labkit.parallel.workers import WorkerError

pytestmark = pytest.mark.slow


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    r = lambda n: torch.randint(0, vocab, (n,), generator=g).tolist()  # noqa: E731
    shared = r(20)
    return [shared + r(5), r(3), shared + r(13), r(37), shared + r(5)]


def _llm(checkpoints, name: str, **kw) -> tuple[LLM, torch.nn.Module]:
    folder, model = checkpoints[name]
    handle = CheckpointHandle(model.config, folder)
    return LLM((handle, None), tensor_parallel_size=2, **kw), model


@pytest.mark.parametrize("name", ["llama_gqa", "llama_mqa", "qwen2_bias", "mistral_window"])
def test_greedy_equals_reference(checkpoints, name):
    # block 4, 12 blocks and a 16-token budget: prefix hits, chunked prefill and preemption
    llm, model = _llm(checkpoints, name, block_size=4, num_blocks=24, max_num_batched_tokens=16,
                      max_num_seqs=4)
    try:
        prompts = _prompts(model.config.vocab_size)
        outs = llm.generate(prompt_token_ids=prompts,
                            sampling_params=SamplingParams(temperature=0, max_tokens=10))
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == generate(model, p, 10)
        stats = llm.llm_engine.stats()
        assert stats["prefix_hit_tokens"] > 0
        steps = llm.llm_engine.trace.steps
        assert any(s["preempted"] for s in steps) or any(
            sc["chunked"] for s in steps for sc in s["scheduled"])
        L, h = model.config.num_hidden_layers, model.config.hidden_size
        for s in steps:
            if not s["scheduled"]:
                continue
            col = s["collectives"]
            assert col["all_reduce"]["count"] == 2 * L + 1
            assert col["all_reduce"]["bytes"] == (2 * L + 1) * s["num_batched_tokens"] * h * 4
            rows = col["all_gather"]["bytes"] // (51 * 4)  # 101-token vocab, 51 rows per rank
            assert col["all_gather"] == {"count": 1, "bytes": rows * 51 * 4}
        assert_no_leaks(llm.llm_engine)
    finally:
        llm.shutdown()


def test_in_memory_model_and_gc(checkpoints):
    _, model = checkpoints["llama_gqa"]
    llm = LLM((model, None), tensor_parallel_size=2)
    procs = list(llm.llm_engine.executor.runner.workers._procs)
    p = _prompts(model.config.vocab_size)[0]
    out = llm.generate(prompt_token_ids=[p], sampling_params=SamplingParams(temperature=0,
                                                                           max_tokens=6))
    assert out[0].outputs[0].token_ids == generate(model, p, 6)
    del llm, out
    gc.collect()
    for proc in procs:
        proc.join(10)
    assert not any(proc.is_alive() for proc in procs), "workers outlived a collected LLM"


def test_a_failing_rank_frees_every_block(checkpoints):
    llm, model = _llm(checkpoints, "llama_gqa")
    eng = llm.llm_engine
    workers = eng.executor.runner.workers
    eng.add_request("a", _prompts(model.config.vocab_size)[0],
                    SamplingParams(temperature=0, max_tokens=20))
    eng.step()
    workers._procs[1].kill()  # a rank dies between steps (OOM killer, segfault)
    with pytest.raises(Exception) as info:
        while eng.has_unfinished_requests():
            eng.step()
    assert isinstance(info.value, WorkerError) or isinstance(info.value.__cause__, WorkerError)
    assert not eng.has_unfinished_requests()
    assert_no_leaks(eng)
    assert not any(p.is_alive() for p in workers._procs)


def test_sizes_that_do_not_divide_fail_before_spawning(checkpoints):
    folder, model = checkpoints["llama_gqa"]  # 4 heads
    with pytest.raises(TensorParallelError, match="not divisible by tensor_parallel_size 3"):
        LLM((CheckpointHandle(model.config, folder), None), tensor_parallel_size=3)


def test_cli_generate_tp_equals_single_process():
    import subprocess
    import sys

    def run(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "labkit.cli", "generate", "--max-tokens",
                               "12", *extra, "def add(a, b):"], capture_output=True, text=True,
                              timeout=300)

    one, two = run(), run("--tp", "2")
    assert one.returncode == two.returncode == 0, two.stderr
    assert two.stdout == one.stdout
    bad = run("--tp", "3")
    assert bad.returncode == 2 and "not divisible by tensor_parallel_size 3" in bad.stderr


@pytest.mark.parametrize("method", ["draft_model", "ngram"])
def test_speculative_verify_pass_on_two_ranks(checkpoints, method):
    _, draft = checkpoints["llama_mqa"]  # same vocabulary, different weights: some rejections
    spec = ({"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
            if method == "draft_model" else {"method": "ngram", "num_speculative_tokens": 3})
    llm, model = _llm(checkpoints, "llama_gqa", speculative_config=spec)
    try:
        prompts = _prompts(model.config.vocab_size)[:3]
        prompts[1] = prompts[1] * 6  # repetition gives the n-gram proposer something to find
        outs = llm.generate(prompt_token_ids=prompts,
                            sampling_params=SamplingParams(temperature=0, max_tokens=12))
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == generate(model, p, 12)
        assert any(s["spec"] for s in llm.llm_engine.trace.steps)
        assert_no_leaks(llm.llm_engine)
    finally:
        llm.shutdown()

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


@pytest.mark.parametrize("name", ["llama_gqa", "llama_mqa", "qwen2_bias", "mistral_window",
                                  "qwen2_window_layers"])
def test_greedy_equals_reference(checkpoints, name):
    # block 4, 24 blocks and a 16-token budget: prefix hits, chunked prefill and preemption (a
    # Mistral-style window frees the blocks it slid past, labkit/kv/hybrid.py: a smaller pool)
    blocks = 13 if name == "mistral_window" else 24
    llm, model = _llm(checkpoints, name, block_size=4, num_blocks=blocks,
                      max_num_batched_tokens=16, max_num_seqs=4)
    try:
        prompts = _prompts(model.config.vocab_size)
        outs = llm.generate(prompt_token_ids=prompts,
                            sampling_params=SamplingParams(temperature=0, max_tokens=10))
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == generate(model, p, 10)
        stats = llm.llm_engine.stats()
        assert stats["prefix_hit_tokens"] > 0
        steps = llm.llm_engine.trace.steps
        assert any(s["preempted"] for s in steps), "no preemption in the run"
        assert any(sc["chunked"] for s in steps for sc in s["scheduled"]), "no chunked prefill"
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
    assert not any(p.is_alive() for p in llm.llm_engine.executor.runner.workers._procs)


def test_worker_process_at_size_one_in_memory_and_gc(checkpoints):
    """distributed_executor_backend="mp" at size 1: the path one GPU runs with NCCL (see
    tests/parallel/gpu_check.py), here one gloo worker whose collectives really go through
    torch.distributed. The model is in memory (its tensors are sent to the worker); the worker
    ends when the LLM is garbage-collected."""
    _, model = checkpoints["qwen2_bias"]
    llm = LLM((model, None), distributed_executor_backend="mp")
    workers = llm.llm_engine.executor.runner.workers
    assert workers.call("describe") == [{"rank": 0, "world": 1, "backend": "gloo",
                                         "device": "cpu", "kv_heads": 2}]
    p = _prompts(model.config.vocab_size)[3]
    out = llm.generate(prompt_token_ids=[p],
                       sampling_params=SamplingParams(temperature=0, max_tokens=6))
    assert out[0].outputs[0].token_ids == generate(model, p, 6)
    steps = [s for s in llm.llm_engine.trace.steps if s["scheduled"]]
    assert steps and all(s["collectives"]["all_reduce"]["count"] == 5 for s in steps)
    procs = list(workers._procs)
    del llm, out, workers
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


def test_cli_generate_tp_equals_single_process(capsys):
    """`labkit generate --tp 2` as a real command (its workers spawned from `python -m
    labkit.cli`) prints what the single-process path prints (run in-process: cheaper)."""
    import subprocess
    import sys

    from labkit.cli import main

    argv = ["generate", "--max-tokens", "12", "def add(a, b):"]
    assert main(argv) == 0
    one = capsys.readouterr().out
    two = subprocess.run([sys.executable, "-m", "labkit.cli", *argv, "--tp", "2"],
                         capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr
    assert two.stdout == one and len(one) > len("def add(a, b):\n")
    with pytest.raises(SystemExit) as bad:
        main([*argv, "--tp", "3"])
    assert bad.value.code == 2
    assert "not divisible by tensor_parallel_size 3" in capsys.readouterr().err


def test_serve_tp_answers_like_one_process():
    """`labkit serve --tp 2` as a real server process: the same greedy completion as the
    in-process engine; stopping the server (SIGTERM) ends its worker processes too."""
    import httpx
    import psutil

    from labkit.serve.process import ServerProcess

    prompt = "class Stack:\n    def push(self, x):"
    want = LLM("labkit-tiny").generate(prompt, SamplingParams(temperature=0, max_tokens=12))
    srv = ServerProcess("labkit-tiny", ["--tp", "2"], startup_timeout=300)
    with srv:
        workers = psutil.Process(srv.pid).children(recursive=True)
        spawned = [p for p in workers if "spawn_main" in " ".join(p.cmdline())]
        assert len(spawned) == 3  # the engine process (labkit serve's default) and 2 ranks
        r = httpx.post(srv.url + "/v1/completions", timeout=120, json={
            "model": "labkit-tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want[0].outputs[0].text
    assert srv.proc.returncode == 0, srv.output()[-2000:]
    gone, alive = psutil.wait_procs(workers, timeout=15)
    assert not alive, "workers outlived the server"


def test_speculative_verify_pass_on_two_ranks(checkpoints):
    """The target's verify pass (k+1 tokens per sequence, rejected tokens' KV overwritten next
    step) on two ranks; a different random model as the draft gives real rejections. (The
    n-gram proposer changes only the driver-side proposals: the verify pass is the same.)"""
    _, draft = checkpoints["llama_mqa"]  # same vocabulary, different weights: some rejections
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 3}
    llm, model = _llm(checkpoints, "llama_gqa", speculative_config=spec)
    try:
        prompts = _prompts(model.config.vocab_size)[:3]
        outs = llm.generate(prompt_token_ids=prompts,
                            sampling_params=SamplingParams(temperature=0, max_tokens=12))
        for p, o in zip(prompts, outs):
            assert o.outputs[0].token_ids == generate(model, p, 12)
        verified = [r for s in llm.llm_engine.trace.steps for r in s["spec"]]
        assert verified and any(r["accepted"] < len(r["proposed"]) for r in verified)
        assert_no_leaks(llm.llm_engine)
    finally:
        llm.shutdown()

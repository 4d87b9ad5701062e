"""CUDA graphs over the full decode graphs (``labkit.engine.cuda_graph``), checked on the CPU.

No GPU here, so the CUDA calls go through ``CPUReplay``, which keeps a CUDA graph's contract:
a replay recomputes the step from the *captured* input tensors and writes into the *captured*
output tensors, and nothing else. That is exactly what makes CUDA graphs easy to get wrong: a
per-step input not copied into its buffer, or a KV cache captured as a copy, replays stale or
private data. The engine's greedy tokens through such replays must equal ``generate``'s; the
negative controls make each of those two mistakes on purpose and the tokens change. What runs
on a real GPU is ``.ci/gpu``'s ``step`` (``labkit bench step-gpu``).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

import labkit
from labkit.engine import cuda_graph, full_graph, piecewise
from labkit.engine.cuda_graph import CPUReplay, CUDAGraphRunner
from labkit.errors import EngineStepError
from labkit.model import testing
from labkit.model.generate import generate

SP = labkit.SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
CHUNKED = dict(block_size=4, max_num_batched_tokens=8)


def _eager_graph(gm: torch.fx.GraphModule, example: list) -> Any:
    return gm  # the traced graph run as it is: the full-graph path without inductor's compile


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, 128, (n,), generator=g).tolist() for n in (6, 11, 3)]


def _run(model: torch.nn.Module, fused: bool = False) -> tuple[list, Any]:
    if fused:
        from labkit.model.fuse import fuse_model

        fuse_model(model)
    report = piecewise.compile_model(model, (1, 4), backend=_eager_graph, pack_weights=False,
                                     cuda_graph_api=CPUReplay())
    llm = labkit.LLM.from_model(model, None, **CHUNKED)
    outs = llm.generate(prompt_token_ids=_prompts(), sampling_params=SP)
    one = llm.generate(prompt_token_ids=_prompts()[:1], sampling_params=SP)
    return [o.outputs[0].token_ids for o in (*outs, *one)], report


@pytest.mark.parametrize("fused", [False, True])  # cos/sin per step, or the rotary table
def test_replayed_decode_steps_give_generates_tokens(fused):
    """Batches of 3 (padded to 4) and 1 decode through replays of captured graphs, one per
    (size, block bucket); the tokens are generate's."""
    model = testing.tiny_model(seed=9)
    want = [generate(model, p, 12, ignore_eos=True) for p in (*_prompts(), _prompts()[0])]
    got, report = _run(model, fused)
    assert got == want
    assert report.cuda_graph_reason is None and report.cuda_graphs >= 3, report
    runners = model.forward.cuda_graphs.runners.values()
    assert sum(r.replays for r in runners) == report.full_steps > 10
    assert f"{report.cuda_graphs} CUDA graphs" in str(report)


def test_a_private_kv_pool_replays_other_tokens(monkeypatch):
    """Negative control: the caches captured as copies (every input treated as per-step), so
    the graph writes and reads a pool the engine never sees; the tokens change."""
    model = testing.tiny_model(seed=9)
    want = [generate(model, p, 12, ignore_eos=True) for p in (*_prompts(), _prompts()[0])]
    every = lambda m: tuple(range(7 + 2 * m.config.num_hidden_layers))  # noqa: E731
    monkeypatch.setattr(piecewise, "step_inputs", every)
    got, _ = _run(model)
    assert got != want


def test_a_per_step_input_left_out_of_the_copy_is_a_named_error(monkeypatch):
    """The other classic mistake: slots, block tables and context lengths treated as held
    (not copied), so a replay would read the first step's. The runner checks that every held
    input is the tensor it captured, and the step fails by name instead of replaying stale
    data (the engine aborts that step's requests)."""
    model = testing.tiny_model(seed=9)
    monkeypatch.setattr(piecewise, "step_inputs", lambda m: (0, 1, 2, 3))
    with pytest.raises(EngineStepError, match="not the tensor the graph was"):
        _run(model)


def test_step_inputs_are_what_changes_between_steps():
    """ids, positions, slots, tables and context lengths always; cos/sin only without the
    rotary table (with it they are the table itself, the same tensor every step)."""
    model = testing.tiny_model(seed=9)
    assert full_graph.step_inputs(model) == (0, 1, 2, 3, 4, 5, 6)
    from labkit.model.fuse import fuse_model

    fuse_model(model)
    assert full_graph.step_inputs(model) == (0, 1, 4, 5, 6)


def test_a_runner_refuses_a_pool_it_was_not_captured_with():
    """Held inputs are captured as themselves: handing the graph another tensor there (a new
    KV pool) is a named error, not a replay into the old one."""
    cache = torch.zeros(4)

    def step(weights, ids, kc):
        kc[ids] = 1.0
        return (kc * 2,)

    runner = CUDAGraphRunner(step, [], (torch.tensor([1]), cache), (0,), "pool", CPUReplay())
    assert runner([], torch.tensor([2]), cache)[0].tolist() == [0, 2, 2, 0]
    with pytest.raises(ValueError, match="not the tensor the graph was captured with"):
        runner([], torch.tensor([2]), torch.zeros(4))
    with pytest.raises(ValueError, match="captured with 2 inputs"):
        runner([], torch.tensor([2]))


def test_on_the_cpu_no_cuda_graphs_and_the_report_says_why():
    model = testing.tiny_model(seed=9)
    report = piecewise.compile_model(model, (1,), backend=_eager_graph)
    assert report.cuda_graphs == 0 and "on cpu" in report.cuda_graph_reason
    assert model.forward.cuda_graphs is None
    off = cuda_graph.cuda_graph_refusal(torch.device("cuda"), enabled=False)
    assert off.startswith("cuda_graphs=False")
    assert cuda_graph.cuda_graph_refusal(torch.device("cuda"), enabled=True) is None


def test_cuda_graphs_takes_a_bool_only():
    """``LLM(cuda_graphs="no")`` would be truthy: refused by name instead of turning them on."""
    from labkit.errors import EngineConfigError

    with pytest.raises(EngineConfigError, match="cuda_graphs must be True or False"):
        labkit.LLM.from_model(testing.tiny_model(seed=9), None, compile=True,
                              cuda_graphs="no")


def test_bench_step_gpu_refuses_without_a_gpu_and_computes_its_ratios(capsys):
    """``labkit bench step-gpu`` (``.ci/gpu``'s ``step``): without CUDA it exits 2 and says
    why; its headline is step-time ratios, checked here on hand-made rows."""
    from labkit.bench import step_gpu

    if not torch.cuda.is_available():
        assert step_gpu.main([]) == 2
        assert "needs a CUDA GPU" in capsys.readouterr().err
    rows = [{"variant": v, "batch": b, "step_ms": ms} for v, b, ms in
            [("eager", 1, 6.0), ("compiled", 1, 3.0), ("cuda-graphs", 1, 1.5),
             ("eager", 64, 8.0), ("compiled", 64, 5.0), ("cuda-graphs", 64, 4.0)]]
    h = step_gpu.headline(rows)
    assert h["b1_cuda_graphs_over_compiled"] == 2.0 and h["b1_cuda_graphs_over_eager"] == 4.0
    assert h["b64_cuda_graphs_over_compiled"] == 1.25 and h["step_ms"]["eager b64"] == 8.0

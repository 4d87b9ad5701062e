"""CUDA graphs for the full decode graphs: a GPU step's kernel launches recorded once, replayed.

On a GPU, inductor's compiled decode step is still a few hundred kernel launches, each a few
microseconds of host work; at batch 1 the GPU finishes a labkit-tiny kernel faster than the host
issues the next, so the step is as slow as its launches. A CUDA graph records the launches once
(``torch.cuda.graph``) and replays them with one call: vLLM and SGLang capture one per batch
size (the capture sizes), which is why their decode steps are near the GPU's own time.

A replay runs the recorded kernels on the recorded addresses. So every input that changes per
step (token ids, positions, slot mapping, block tables, context lengths; the rotary cos/sin
rows when the model has no table) gets a *static buffer* the step's values are copied into
before the replay, and every input that must stay the same tensor (the weights, the KV pool's
caches, the rotary table) is captured as itself: a copy there would make the graph write its
K/V into a private copy of the pool. The outputs are the graph's own static tensors, valid
until the next replay (the engine samples from them before it runs another step).

:class:`CUDAGraphRunner` does this for one :class:`~labkit.engine.graph_capture.CapturedGraph`
at one (capture size, block bucket). The CUDA calls go through ``api`` (default
:data:`CUDA_API`), the seam that lets the CPU replay through the same buffers (:class:`CPUReplay`:
``tests/engine/test_cuda_graph_runner.py``, notebook 15); what runs on a GPU is ``.ci/gpu``'s
``step``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch


class TorchCUDA:
    """The four CUDA-graph calls the runner makes, as torch provides them."""

    def new_graph(self) -> Any:
        return torch.cuda.CUDAGraph()

    def capture(self, graph: Any, pool: Any, fn: Callable[[], Any]) -> Any:
        """Record ``fn``'s launches into ``graph``; its outputs become the graph's static
        outputs (nothing runs: replays compute them)."""
        with torch.cuda.graph(graph, pool=pool):
            return fn()

    def pool(self) -> Any:
        return torch.cuda.graph_pool_handle()

    def warm_up(self, fn: Callable[[], Any]) -> None:
        """Run ``fn`` on a side stream (what capture requires: inductor's first call compiles
        and autotunes Triton kernels, and lazy CUDA state must exist before recording)."""
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        torch.cuda.current_stream().wait_stream(stream)


CUDA_API = TorchCUDA()


class _Replay:
    """What :class:`CPUReplay` records: the captured step and its static outputs."""

    def replay(self) -> None:
        for held, new in zip(self.outputs, self.fn()):
            held.copy_(new)


class CPUReplay:
    """A CUDA graph's contract without a GPU: a replay recomputes the captured step from the
    *captured* input tensors and writes into the *captured* output tensors, nothing else. The
    runner's buffers behave as on a GPU, so its mistakes (an input not copied, a cache
    captured as a copy) show on a CPU (the tests and notebook 15 use it)."""

    def new_graph(self) -> _Replay:
        return _Replay()

    def capture(self, graph: _Replay, pool: Any, fn: Callable[[], Any]) -> Any:
        graph.fn, graph.outputs = fn, fn()
        return graph.outputs

    def pool(self) -> None:
        return None

    def warm_up(self, fn: Callable[[], Any]) -> None:
        fn()


class CUDAGraphRunner:
    """One compiled step captured as a CUDA graph: ``runner(weights, *args)`` copies the
    per-step ``args`` (indices ``per_step``) into static buffers and replays.

    ``fn(weights, *args)`` is the compiled graph; ``args`` the first step's inputs (the
    capture's); ``pool`` the memory pool shared by every graph of a model (its graphs never
    run at once, so their intermediates can share memory, as vLLM's do)."""

    def __init__(self, fn: Callable[..., Any], weights: list[torch.Tensor], args: Sequence,
                 per_step: Sequence[int], pool: Any, api: Any = CUDA_API) -> None:
        self.per_step = tuple(per_step)
        self.inputs = [a.clone() if i in self.per_step else a for i, a in enumerate(args)]

        def step() -> Any:
            return fn(weights, *self.inputs)

        # the warm-up computes what the first step computes (the same K/V into the same
        # slots), so running it before the replay changes nothing a step would not
        api.warm_up(step)
        self.graph = api.new_graph()
        self.outputs = api.capture(self.graph, pool, step)
        self.replays = 0

    def __call__(self, weights: list[torch.Tensor], *args: torch.Tensor) -> Any:
        if len(args) != len(self.inputs):
            raise ValueError(f"the graph was captured with {len(self.inputs)} inputs, "
                             f"got {len(args)}")
        for i, (held, given) in enumerate(zip(self.inputs, args)):
            if i not in self.per_step and held.data_ptr() != given.data_ptr():
                raise ValueError(f"input {i} is not the tensor the graph was captured with "
                                 "(a new KV pool or rotary table needs its own graph)")
        for i in self.per_step:
            self.inputs[i].copy_(args[i])
        self.graph.replay()
        self.replays += 1
        return self.outputs


def cuda_graph_refusal(device: torch.device, enabled: bool) -> str | None:
    """Why the full decode graphs are not captured as CUDA graphs (None: they are)."""
    if not enabled:
        return "cuda_graphs=False: inductor's launches run every step"
    if device.type != "cuda":
        return (f"the model is on {device.type}: no CUDA graphs (on a CPU the full graph's "
                "C++ wrapper is the one-call step)")
    return None


class CUDAGraphs:
    """The CUDA graphs of one compiled model, one per (graph kind, size, KV pool), captured on
    first use and sharing one memory pool."""

    def __init__(self, api: Any = CUDA_API) -> None:
        self.api = api
        self.runners: dict[tuple, CUDAGraphRunner] = {}
        self._pool: Any = None

    def run(self, fn: Callable[..., Any], weights: list[torch.Tensor], args: Sequence,
            per_step: Sequence[int], key: tuple) -> Any:
        """``fn(weights, *args)`` through the CUDA graph captured for ``key``."""
        runner = self.runners.get(key)
        if runner is None:
            if self._pool is None:
                self._pool = self.api.pool()
            runner = self.runners[key] = CUDAGraphRunner(fn, weights, args, per_step,
                                                         self._pool, self.api)
        return runner(weights, *args)

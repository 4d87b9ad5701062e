"""Timing GPU kernels honestly: what a kernel costs on the device, not what Python costs.

Two traps this avoids:
- Launch overhead. ``do_bench`` times each call between CUDA events, so when the host needs
  longer to launch a call (argument binding, allocations, several launches) than the device
  needs to run it, the events measure the host. A 10 µs kernel can read 80 µs. Capturing the
  calls in a CUDA graph and timing its replays measures device time only; it is also how
  serving engines run decode steps.
- A warm L2 cache. Replaying one call over the same 8 MB of weights reads them from the 50+ MB
  L2 after the first time. So each replay runs the call over several *copies* of its large
  inputs, enough of them that together they are several times the L2, as a real model's
  layers would be.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch

ROTATE_BYTES = 256 << 20  # rotate through at least this many bytes of inputs per replay
BIG_TENSOR = 1 << 20  # only inputs at least this large are copied for rotation


def eager_time_ms(fn: Callable[[], Any], warmup_ms: int = 10, rep_ms: int = 40) -> float:
    """Median ms of ``fn`` launched from Python (includes launch overhead), L2 flushed."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def rotated_inputs(args: Sequence[Any], rotate_bytes: int = ROTATE_BYTES,
                   max_copies: int = 64) -> list[tuple]:
    """``args`` plus clones of its large tensors, enough to stream ``rotate_bytes``."""
    big = [i for i, a in enumerate(args)
           if torch.is_tensor(a) and a.numel() * a.element_size() >= BIG_TENSOR]
    footprint = sum(args[i].numel() * args[i].element_size() for i in big)
    copies = 1 if footprint == 0 else max(1, min(max_copies, math.ceil(rotate_bytes / footprint)))
    sets = [tuple(args)]
    for _ in range(copies - 1):
        sets.append(tuple(a.clone() if i in big else a for i, a in enumerate(args)))
    return sets


def graph_time_ms(fn: Callable[..., Any], args: Sequence[Any] = (), replays: int = 10,
                  rotate_bytes: int = ROTATE_BYTES) -> float:
    """Median device ms per call of ``fn(*args)``: one CUDA graph runs the call once per
    rotated input copy; the graph's replay time is divided by the number of copies."""
    calls = [partial(fn, *s) for s in rotated_inputs(args, rotate_bytes)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: compile, autotune caches, lazy host state
        for call in calls * 2:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / len(calls))
    del graph
    return statistics.median(times)

"""How fast a batch-1 decode reads its weights: the library matmul against a dot-product loop.

At one token every linear layer is a matrix-vector product, and a decode step's floor is the
time to read all of the model's weights once. This measures that reading speed two ways, over
the model's own linear weights (every layer's projections and the LM head, in forward order,
one token's activations):

* ``linear``: ``F.linear`` on each weight, eager: the BLAS library's ``sgemm`` (what the eager
  engine and the compiled pieces above one token run);
* ``dot``: one inductor-compiled graph of :func:`labkit.engine.dot_linear.dot_linear` over all
  of them (what the compiled 1-token pieces run): a vectorised dot product per output row.

Both in one process, alternating rounds, medians; gigabytes per second = the weights' bytes
over the time of one pass. Part of ``labkit bench step`` (``gemv`` in its JSON).

Beside it, the other floor ``bench step`` reports: one hand-off to a worker thread and back
(:func:`thread_round_trip_us`, ``handoff_us``), what overlap scheduling pays per step.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _linear_weights(model: nn.Module) -> list[torch.Tensor]:
    """Every ``nn.Linear`` weight of the model, in module order (the LM head last); a tied
    head counts once per use, as a step reads it."""
    return [m.weight.detach() for m in model.modules() if isinstance(m, nn.Linear)]


def _compiled_dots(weights: list[torch.Tensor], x: torch.Tensor) -> Any:
    """One graph: ``dot_linear(x, w)`` for every weight, traced once and compiled by inductor
    (as :mod:`labkit.engine.piecewise` builds its pieces)."""
    from torch._inductor.compile_fx import compile_fx
    from torch.fx.experimental.proxy_tensor import make_fx

    from labkit.engine.dot_linear import dot_linear

    def dots(x: torch.Tensor, *ws: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(dot_linear(x, w) for w in ws)

    with torch.no_grad():
        gm = make_fx(dots)(x, *weights)
        return compile_fx(gm, [x, *weights])


def weight_streaming(model: nn.Module, rounds: int = 7, passes: int = 20) -> dict[str, Any]:
    """GB/s of one pass over the model's linear weights, eager ``F.linear`` vs the compiled
    dot-product graphs (one per input width: hidden size, MLP width), medians of ``rounds``
    alternating rounds of ``passes`` passes each; and the largest difference between the two
    ways' outputs (float32 summation order only)."""
    weights = _linear_weights(model)
    g = torch.Generator().manual_seed(0)
    widths = sorted({w.shape[1] for w in weights})
    xs = {n: torch.randn(1, n, generator=g).to(weights[0].dtype) for n in widths}
    groups = {n: [w for w in weights if w.shape[1] == n] for n in widths}
    graphs = {n: _compiled_dots(groups[n], xs[n]) for n in widths}

    def run_linear() -> list[torch.Tensor]:
        return [F.linear(xs[w.shape[1]], w) for w in weights]

    def run_dot() -> list[torch.Tensor]:
        return [y for n in widths for y in graphs[n](xs[n], *groups[n])]

    times: dict[str, list[float]] = {"linear": [], "dot": []}
    with torch.no_grad():
        for r in range(rounds + 1):
            order = (("linear", run_linear), ("dot", run_dot))
            for name, fn in order if r % 2 else order[::-1]:
                t = time.perf_counter()
                for _ in range(passes):
                    fn()
                if r:  # round 0 warms both
                    times[name].append((time.perf_counter() - t) / passes)
        want = {id(w): y for w, y in zip(weights, run_linear())}
        got = dict(zip([id(w) for n in widths for w in groups[n]], run_dot()))
        err = max(float((got[k] - want[k]).abs().max()) for k in want)
    nbytes = sum(w.numel() * w.element_size() for w in weights)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {"weights": len(weights), "bytes": nbytes,
            "linear_gb_s": nbytes / med["linear"] / 1e9, "dot_gb_s": nbytes / med["dot"] / 1e9,
            "dot_over_linear": med["linear"] / med["dot"], "max_abs_diff": err,
            "rounds": rounds, "passes": passes}


def thread_round_trip_us(trips: int = 400) -> float:
    """Median microseconds to hand a no-op to a worker thread and get its result back (a
    submit, a wake-up, a result): what handing each step's forward to a worker would put on
    the step's path, and why overlap scheduling (:mod:`labkit.engine.overlap`) keeps the
    forward on the calling thread. On a VM an idle vCPU's wake-up alone can be tens of
    microseconds."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        pool.submit(int).result()  # the thread exists before the clock starts
        times = []
        for _ in range(trips):
            t = time.perf_counter()
            pool.submit(int).result()
            times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)

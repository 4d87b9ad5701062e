"""Trace once, compile once, call directly: the graphs behind ``compile=True``'s pieces.

:mod:`labkit.engine.piecewise` cuts the forward into pieces; this module turns one piece at one
capture size into a compiled function. The piece is a module around weightless template layers
(:class:`Piece`); :class:`CapturedGraph` traces it to ATen operators with every weight and
activation as a flat input (``make_fx``), hands that graph to the backend once (inductor's
``compile_fx``), and from then on calls the result directly.

Two things travel with each compile rather than through inductor's global settings, because
torch 2.13 keeps those settings per thread (a value set on the main thread is not seen by a
compile on another thread: a server runs its engine on a thread of its own):
:func:`inductor_options` gives them, and :class:`CapturedGraph` applies them around its compile.

- ``cpp_wrapper``: inductor writes the code that calls a graph's kernels as C++ instead of
  Python. A Python wrapper runs a few lines of Python per kernel (hundreds per decode step) and
  holds the GIL between kernels; the C++ wrapper is one call that releases the GIL for the whole
  graph. On a CPU that is what a CUDA graph is on a GPU: the step's launches replayed without
  the interpreter. It costs compile time (the wrapper includes torch's headers: about twice
  the seconds), so only the full decode graphs, called once per step, use it.
- ``cpp.simdlen``: the vector width, pinned to ``$ATEN_CPU_CAPABILITY`` when that is set
  (:func:`match_aten_vector_width` says why).
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


class Piece(nn.Module):
    """``fn(*templates, *args)`` around weightless template layers (``t0``, ``t1``): what
    :func:`torch.func.functional_call` runs with any layer's weights, so one graph per capture
    size serves every layer (the weights are graph inputs)."""

    def __init__(self, fn: Any, *templates: nn.Module) -> None:
        super().__init__()
        self.fn = fn
        self.templates = nn.ModuleList(templates)

    def forward(self, *args: torch.Tensor) -> Any:
        return self.fn(*self.templates, *args)


def piece_weights(*modules: nn.Module) -> dict[str, torch.Tensor]:
    """The modules' parameters and buffers under a piece's names (``templates.<i>.<name>``):
    the tensors themselves, so an in-place update (``copy_weights``) reaches the graphs."""
    out: dict[str, torch.Tensor] = {}
    for i, m in enumerate(modules):
        out.update(m.named_parameters(prefix=f"templates.{i}"))
        out.update(m.named_buffers(prefix=f"templates.{i}"))
    return out


class CapturedGraph:
    """One piece compiled at one size: traced to ATen ops with the weights and activations as
    flat inputs (``make_fx``), handed to the backend once, then called directly. Why not
    ``torch.compile`` per call: its guards check every input, weights included, before each
    call (tens of microseconds, 7 calls a step); vLLM also drops dynamo's guards once a graph is
    captured (vllm/compilation/wrapper.py). The shapes are fixed by the capture size, so the
    guards have nothing to decide."""

    def __init__(self, piece: Piece, weights: dict[str, torch.Tensor], args: tuple,
                 backend: Any, options: dict[str, Any] | None = None) -> None:
        from torch.fx.experimental.proxy_tensor import make_fx

        self.names = list(weights)
        n = len(self.names)

        def flat(*tensors: torch.Tensor) -> Any:
            out = torch.func.functional_call(piece, dict(zip(self.names, tensors[:n])),
                                             tensors[n:], tie_weights=False)
            return out if isinstance(out, tuple) else (out,)

        with torch.inference_mode(False), torch.no_grad():
            example = [t.clone() if t.is_inference() else t
                       for t in (*weights.values(), *args)]
            # fake tensors: nothing is computed while tracing, and every node's example value
            # comes from one fake mode (the C++ wrapper's compile insists on that)
            gm = make_fx(flat, tracing_mode="fake")(*example)
            with _inductor_config(options):
                self.compiled = backend(gm, example)

    def __call__(self, weights: list[torch.Tensor], *args: torch.Tensor) -> Any:
        callback = getattr(_LAUNCH, "callback", None)
        if callback is not None:
            _LAUNCH.callback = None
            callback()
        return self.compiled(*weights, *args)


_LAUNCH = threading.local()  # the callback on_launch set on this thread, if any


@contextmanager
def on_launch(callback: Callable[[], None]) -> Iterator[None]:
    """Call ``callback`` once, when this thread next calls a compiled graph (or never).

    Why: the overlap scheduler (:mod:`labkit.engine.overlap`) runs its host thread's Python
    while the forward is inside a graph. Started earlier, while the forward still runs Python
    (the model's forward up to the graph), the two threads take turns at the GIL and what is
    hidden on one side is paid on the other."""
    _LAUNCH.callback = callback
    try:
        yield
    finally:
        _LAUNCH.callback = None


@contextmanager
def _inductor_config(options: dict[str, Any] | None) -> Iterator[None]:
    if not options:
        yield
        return
    from torch._inductor import config

    with config.patch(options):
        yield


def backend_compiler(backend: Any) -> Any:
    """``"inductor"``: inductor's ``compile_fx``; else a callable ``(gm, example_inputs) ->
    callable`` (the contract of torch.compile's backends)."""
    if backend == "inductor":
        from torch._inductor.compile_fx import compile_fx

        return compile_fx
    if not callable(backend):
        raise ValueError(f"backend must be 'inductor' or a callable, got {backend!r}")
    return backend


def cxx_compiler() -> str | None:
    """The C++ compiler inductor would build CPU kernels with, or None (``$CXX``, then
    inductor's own candidates)."""
    from torch._inductor import config

    names = [os.environ.get("CXX")] + list(config.cpp.cxx)
    return next((p for n in names if n and (p := shutil.which(n))), None)


_SIMDLEN = {"default": 0, "avx2": 256, "avx512": 512}  # ATEN_CPU_CAPABILITY -> vector bits


def inductor_options(cpp_wrapper: bool = False) -> dict[str, Any]:
    """The inductor settings one compile runs under (given to :class:`CapturedGraph`): the C++
    wrapper if asked, and the vector width: this thread's if one was chosen (by the user, or
    pinned by :func:`match_aten_vector_width`), else ``$ATEN_CPU_CAPABILITY``'s when that is
    set (see the module doc)."""
    from torch._inductor import config

    options: dict[str, Any] = {"cpp_wrapper": cpp_wrapper}
    width = config.cpp.simdlen
    if width is None:
        width = _SIMDLEN.get(os.environ.get("ATEN_CPU_CAPABILITY", ""))
    if width is not None:
        options["cpp.simdlen"] = width
    return options


def match_aten_vector_width() -> int | None:
    """Pin inductor's CPU vector width to ``$ATEN_CPU_CAPABILITY`` when that is set (how the
    lab's CI runs another CPU's kernels), for this thread's own ``torch.compile`` calls (the
    engine's graphs get it from :func:`inductor_options`); returns the width set, or None.

    Why: with the variable set and ``cpp.simdlen`` unset, torch 2.13's inductor takes its
    vector ISA from the variable but other parts of its code generation from the CPU, and
    the kernels it builds are wrong (``avx2`` on an AVX-512 machine: an add + RMSNorm off
    by 1e29) or do not compile (``default``). The same width given as ``cpp.simdlen`` is
    consistent, and correct."""
    from torch._inductor import config

    width = _SIMDLEN.get(os.environ.get("ATEN_CPU_CAPABILITY", ""))
    if width is None or config.cpp.simdlen is not None:
        return None
    config.cpp.simdlen = width
    return width

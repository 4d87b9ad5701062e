"""Piecewise compilation: ``torch.compile`` (inductor) of everything in a forward but attention.

A decode step of a small model is mostly Python and dispatch: each layer runs ~20 small PyTorch
ops, each a call through the dispatcher and a kernel launch. A compiler fuses them into a few
generated kernels per piece. What it should not touch is the paged-attention call: its inputs
(block tables, slot mapping, the step's metadata on ``kv_cache``) change every step, and its
backends (PyTorch or Triton) are already written for the job. So, as vLLM does with its
piecewise CUDA graphs, the forward is cut at every ``kv_cache.attend``::

    embed, rope lookup           eager
    layer i:  pre_attention      compiled  residual add + input norm, q|k|v, q/k norm, rotary
              kv_cache.attend    eager     writes K/V into their slots, attends over the blocks
              post_attention     compiled  o_proj, residual add + post norm, MLP
    final add + norm, LM head    eager     (hooks on model.norm keep working: EAGLE, profiler)

Every layer runs the same two compiled functions: a weightless copy of layer 0 is the template,
and ``torch.func.functional_call`` runs it with each layer's weights as graph inputs, so one
graph per piece and size serves all layers and dynamo's guards check tensor shapes only (passing
the layer module itself made one cache entry per layer, and every call walked those entries'
guards on module state). ``dynamic=False`` with the token
count *padded up to a capture size* (vLLM's ``cudagraph_capture_sizes``, 1, 2, 4, ..., 512): one
graph per size, never a recompile per new batch size, and the pad sliced off before attention
and at the end. A larger step (a long prefill chunk), a batch of rows (``generate`` with B > 1),
a forward without a cache or with extra inputs run eager. Sizes compile lazily, on first use;
:class:`CompileReport` counts the seconds each took (and a log line, ``labkit.engine.piecewise``
at INFO, says each).

If inductor cannot run (no C++ compiler on a CPU machine; a compile that fails on the first
size), the model stays eager and the report says why (``reason``), with a warning: never a
silent fallback. The pieces call ``.forward`` of the norms and the MLP directly, so module
hooks (the step profiler's per-layer timers) are not traced into a graph; the profiler's
phases still time the whole forward.
"""

from __future__ import annotations

import bisect
import copy
import logging
import shutil
import time
import types
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)
CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # vLLM's default capture sizes


@dataclass
class CompileReport:
    """What ``compile=True`` did: ``compiled`` False with a ``reason`` when the model runs
    eager; ``compile_s`` the seconds of each capture size's first forward (compile + run)."""

    compiled: bool
    reason: str | None
    backend: str
    capture_sizes: list[int]
    compile_s: dict[int, float] = field(default_factory=dict)
    eager_forwards: int = 0  # forwards too large (or shaped otherwise) for a compiled piece

    @property
    def total_s(self) -> float:
        return sum(self.compile_s.values())

    def __str__(self) -> str:
        if not self.compiled:
            return f"not compiled ({self.reason}); the model runs eager"
        done = ", ".join(f"{n}: {s:.1f} s" for n, s in sorted(self.compile_s.items()))
        return (f"piecewise {self.backend}: {len(self.compile_s)} of {len(self.capture_sizes)} "
                f"sizes compiled in {self.total_s:.1f} s ({done or 'none yet'})")


def cxx_compiler() -> str | None:
    """The C++ compiler inductor would build CPU kernels with, or None (``$CXX``, then
    inductor's own candidates)."""
    import os

    from torch._inductor import config

    names = [os.environ.get("CXX")] + list(config.cpp.cxx)
    return next((p for n in names if n and (p := shutil.which(n))), None)


_SIMDLEN = {"default": 0, "avx2": 256, "avx512": 512}  # ATEN_CPU_CAPABILITY -> vector bits


def match_aten_vector_width() -> int | None:
    """Pin inductor's CPU vector width to ``$ATEN_CPU_CAPABILITY`` when that is set (how the
    lab's CI runs another CPU's kernels); returns the width set, or None.

    Why: with the variable set and ``cpp.simdlen`` unset, torch 2.13's inductor takes its
    vector ISA from the variable but other parts of its code generation from the CPU, and
    the kernels it builds are wrong (``avx2`` on an AVX-512 machine: an add + RMSNorm off
    by 1e29) or do not compile (``default``). The same width given as ``cpp.simdlen`` is
    consistent, and correct."""
    import os

    from torch._inductor import config

    width = _SIMDLEN.get(os.environ.get("ATEN_CPU_CAPABILITY", ""))
    if width is None or config.cpp.simdlen is not None:
        return None
    config.cpp.simdlen = width
    return width


def cannot_compile(model: nn.Module) -> str | None:
    """Why inductor cannot compile this model here (None: it can try)."""
    specs = [model.config.layer_spec(i).mlp for i in range(model.config.num_hidden_layers)]
    if any(s != "dense" for s in specs):
        return ("mixture-of-experts layers route tokens data-dependently (top-k, per-expert "
                "groups): they run eager")
    if getattr(model.config, "gemma3", None) is not None:
        return ("Gemma 3's sandwich norms are not the fused add + norm the pieces are cut at: "
                "it runs eager")
    kinds = {(tuple((n, t.shape, t.dtype) for n, t in _layer_weights(layer).items()),
              tuple(type(m) for m in layer.modules())) for layer in model.model.layers}
    loose = [f"{type(m).__name__}.{k}" for layer in model.model.layers[:1] for m in
             layer.modules() for k, v in vars(m).items() if isinstance(v, torch.Tensor)]
    if loose:  # functional_call swaps parameters and buffers only
        return f"tensor attributes that are neither parameters nor buffers: {loose[:3]}"
    if len(kinds) > 1:
        return ("its layers differ in weights or modules: one compiled graph per piece serves "
                "every layer only when they are alike")
    if model.device.type == "cpu" and cxx_compiler() is None:
        return "no C++ compiler found (inductor builds its CPU kernels with one; set $CXX)"
    if model.device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "triton is not installed (inductor's GPU kernels are Triton kernels)"
    return None


def pre_attention(layer: nn.Module, x: torch.Tensor, residual: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Residual add + input norm, q|k|v, rotary: layer's work before the KV cache."""
    h, residual = layer.input_layernorm.forward(x, residual)
    q, k, v = layer.self_attn.qkv_rope(h, cos, sin)
    return q, k, v, residual


def post_attention(layer: nn.Module, out: torch.Tensor, residual: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """o_proj, residual add + post-attention norm, MLP: layer's work after the KV cache."""
    x = layer.self_attn.o_proj(out.flatten(-2))
    h, residual = layer.post_attention_layernorm.forward(x, residual)
    return layer.mlp.forward(h), residual


class _LayerPiece(nn.Module):
    """``fn(layer, *args)`` as a module around one layer: the template that
    :func:`torch.func.functional_call` runs with any layer's weights, so one graph per capture
    size serves every layer (the weights are graph inputs; the guards check tensor shapes, not
    which layer: a module argument made one cache entry per layer and a guard walk across them
    on every call)."""

    def __init__(self, layer: nn.Module, fn: Any) -> None:
        super().__init__()
        self.layer, self.fn = layer, fn

    def forward(self, *args: torch.Tensor) -> Any:
        return self.fn(self.layer, *args)


def _layer_weights(layer: nn.Module) -> dict[str, torch.Tensor]:
    """A layer's parameters and buffers under the template's names (``layer.<name>``): the
    tensors themselves, so an in-place update (``copy_weights``) reaches the compiled graphs."""
    named = list(layer.named_parameters(prefix="layer")) + list(layer.named_buffers(
        prefix="layer"))
    return dict(named)


class PiecewiseForward:
    """The model's forward with compiled pieces; installed on the instance by
    :func:`compile_model` (``model.forward``), ``model.forward.report`` its report."""

    def __init__(self, model: nn.Module, capture_sizes: tuple[int, ...], backend: str,
                 report: CompileReport) -> None:
        self.model = model
        self.eager = types.MethodType(type(model).forward, model)
        self.sizes = sorted(capture_sizes)
        self.report = report
        # a copy of layer 0 on the meta device: every tensor it runs with is a graph input (a
        # real layer as template made dynamo guard "this weight *is* layer 0's": a recompile)
        layer0 = copy.deepcopy(model.model.layers[0]).to("meta")
        templates = _LayerPiece(layer0, pre_attention), _LayerPiece(layer0, post_attention)
        self.pre = torch.compile(lambda w, *a: torch.func.functional_call(templates[0], w, a),
                                 dynamic=False, backend=backend)
        self.post = torch.compile(lambda w, *a: torch.func.functional_call(templates[1], w, a),
                                  dynamic=False, backend=backend)
        self.weights: list[dict[str, torch.Tensor]] | None = None  # per layer, at first use

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                 kv_cache: Any = None, logits_indices: torch.Tensor | None = None,
                 **model_inputs: Any) -> torch.Tensor:
        T = input_ids.shape[-1]
        if (not self.report.compiled or model_inputs or kv_cache is None or positions is None
                or input_ids.dim() != 2 or input_ids.shape[0] != 1 or T > self.sizes[-1]):
            if self.report.compiled:
                self.report.eager_forwards += 1
            return self.eager(input_ids, positions, kv_cache, logits_indices, **model_inputs)
        size = self.sizes[bisect.bisect_left(self.sizes, T)]
        if size in self.report.compile_s:
            return self._forward(input_ids, positions, kv_cache, logits_indices, size)
        t0 = time.perf_counter()
        try:
            out = self._forward(input_ids, positions, kv_cache, logits_indices, size)
        except Exception as e:  # noqa: BLE001 - inductor's failures have no common type
            if self.report.compile_s:  # a size compiled before: not a compiler problem
                raise
            self._give_up(f"the first compile failed: {type(e).__name__}: {str(e)[:300]}")
            return self.eager(input_ids, positions, kv_cache, logits_indices)
        self.report.compile_s[size] = time.perf_counter() - t0
        logger.info("compile=True: %d-token graphs built in %.1f s (%s)", size,
                    self.report.compile_s[size], self.report)
        return out

    def _give_up(self, reason: str) -> None:
        self.report.compiled, self.report.reason = False, reason
        warnings.warn(f"compile=True: {reason}; running eager", RuntimeWarning, stacklevel=3)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: Any,
                 logits_indices: torch.Tensor | None, size: int) -> torch.Tensor:
        m, T = self.model, input_ids.shape[1]
        if int(positions.max()) >= m.config.max_position_embeddings:
            return self.eager(input_ids, positions, kv_cache, logits_indices)  # its error
        pad = size - T
        x = m.model.embed_tokens(F.pad(input_ids, (0, pad)))
        pos = F.pad(positions, (0, pad))  # position 0 for the pad rows: any valid one
        cos, sin = m.rope(pos, x.dtype)
        residual = torch.zeros_like(x)  # layer 0's add is x + 0 = x, exactly
        if self.weights is None:  # after fuse_model, which makes the fused tensors
            self.weights = [_layer_weights(layer) for layer in m.model.layers]
        for layer, w in zip(m.model.layers, self.weights):
            q, k, v, residual = self.pre(w, x, residual, cos, sin)
            out = kv_cache.attend(layer.self_attn.layer_idx, q[:, :T], k[:, :T], v[:, :T],
                                  positions)
            x, residual = self.post(w, F.pad(out, (0, 0, 0, 0, 0, pad)), residual)
        x = m.model.norm((x + residual)[:, :T])
        if logits_indices is not None:
            x = x.reshape(T, -1)[logits_indices]
        return m.lm_head(x)


def compile_model(model: nn.Module, capture_sizes: tuple[int, ...] = CAPTURE_SIZES,
                  backend: str = "inductor") -> CompileReport:
    """Install :class:`PiecewiseForward` as ``model.forward`` (in place) and return its report;
    a model that cannot be compiled here keeps its forward, and the report (and a warning)
    say why. A model already compiled returns its existing report."""
    current = vars(model).get("forward")
    if isinstance(current, PiecewiseForward):
        return current.report
    if not capture_sizes or min(capture_sizes) < 1:
        raise ValueError(f"capture sizes must be positive token counts, got {capture_sizes}")
    report = CompileReport(True, None, backend, sorted(capture_sizes))
    reason = cannot_compile(model) if backend == "inductor" else None
    if reason is not None:
        report.compiled, report.reason = False, reason
        warnings.warn(f"compile=True: {reason}; running eager", RuntimeWarning, stacklevel=2)
        return report
    if backend == "inductor":
        match_aten_vector_width()
    # a cache entry per capture size (and per grad mode) of each piece: room for all of them
    limit = len(capture_sizes) * (model.config.num_hidden_layers + 1) * 2
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
    model.forward = PiecewiseForward(model, tuple(capture_sizes), backend, report)
    return report

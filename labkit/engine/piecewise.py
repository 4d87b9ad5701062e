"""Piecewise compilation: inductor compiles everything in a forward but attention.

A decode step of a small model is mostly Python and dispatch: each layer runs ~20 small PyTorch
ops, each a call through the dispatcher and a kernel launch. A compiler fuses them into a few
generated kernels per piece. What it should not touch is the paged-attention call: its inputs
(block tables, slot mapping, the step's metadata on ``kv_cache``) change every step, and its
backends (PyTorch or Triton) are already written for the job. So, as vLLM does with its
piecewise CUDA graphs, the forward is cut at every ``kv_cache.attend``; all the work between
two attention calls is one piece (L + 1 piece calls per step for L layers, plus the LM head)::

    embed, rope lookup           eager
    pre_attention                compiled  residual add + input norm, q|k|v, q/k norm, rotary
    layer i:  kv_cache.attend    eager     writes K/V into their slots, attends over the blocks
              between_attention  compiled  layer i's o_proj, add + norm, MLP; then layer i+1's
                                           pre_attention (the last layer: last_attention, its
                                           post-attention work and the final residual add)
    final norm                   eager     (hooks on model.norm keep working: EAGLE, profiler)
    LM head                      compiled  at 1 row (a dot-product loop); a matmul above

Every layer runs the same compiled graphs: a weightless copy of layer 0 is the template, and
``torch.func.functional_call`` runs it with each layer's weights as graph inputs, so one graph
per piece and size serves all layers. Shapes are fixed by *padding the token count up to a
capture size* (vLLM's ``cudagraph_capture_sizes``, 1, 2, 4, ..., 512): one graph per size,
never a recompile per new batch size, and the pad sliced off before attention and at the end.
Each graph is traced once to ATen ops (``make_fx``), compiled once (inductor's ``compile_fx``)
and then called directly, without ``torch.compile``'s guards
(:class:`~labkit.engine.graph_capture.CapturedGraph` says why). At one token the pieces'
linear layers are dot-product loops (:mod:`labkit.engine.dot_linear`: a decode step's matmuls
are bound by reading the weights); above one token, on a CPU, they are oneDNN matmuls over
weights packed once into its blocked layout (:mod:`labkit.engine.packed_linear`, a packed copy
of each weight beside it). A larger step (a long prefill chunk), a batch of rows (``generate``
with B > 1), a forward without a cache or with extra inputs run eager. Sizes compile lazily,
on first use; :class:`CompileReport` counts the seconds each took (and a log line,
``labkit.engine.piecewise`` at INFO, says each).

A step where every sequence decodes one token skips the pieces: it runs as one graph with
attention inside (:mod:`labkit.engine.full_graph`, the default ``compile_mode``).

If inductor cannot run (no C++ compiler on a CPU machine; a compile that fails on the first
size), the model stays eager and the report says why (``reason``), with a warning: never a
silent fallback. The pieces call ``.forward`` of the norms and the MLP directly, so module
hooks (the step profiler's per-layer timers) are not traced into a graph; the profiler's
phases still time the whole forward.
"""

from __future__ import annotations

import bisect
import contextlib
import copy
import logging
import time
import types
import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from labkit.engine.compile_report import CompileReport
from labkit.engine.cuda_graph import CUDA_API, CUDAGraphs, cuda_graph_refusal
from labkit.engine.dot_linear import use_dot_products
from labkit.engine.full_graph import (
    KERNEL,
    decode_piece,
    full_graph_args,
    is_uniform_decode,
    kernel_refusal,
    static_refusal,
    step_inputs,
    step_refusal,
)
from labkit.engine.graph_capture import (
    CapturedGraph,
    Piece,
    backend_compiler,
    cxx_compiler,
    inductor_options,
    match_aten_vector_width,
    piece_weights,
)
from labkit.engine.packed_linear import (
    PackedWeights,
    cannot_pack,
    packed_linear,
    packed_op_as_library_call,
    use_packed_weights,
)
from labkit.engine.pieces import (  # noqa: F401 - the pieces' functions, named from here too
    between_attention,
    last_attention,
    lm_head,
    post_attention,
    pre_attention,
)

logger = logging.getLogger(__name__)
CAPTURE_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)  # vLLM's default capture sizes
WRAPPERS = ("cpp", "python")  # how a full graph calls its kernels (inductor's cpp_wrapper)
DOT_MAX_TOKENS = 1  # pieces of up to this many tokens compute linears as dot_linear (measured:
# at 2 and 4 tokens inductor's loop re-reads each weight per token and the matmul wins)


def cannot_compile(model: nn.Module) -> str | None:
    """Why inductor cannot compile this model here (None: it can try)."""
    specs = [model.config.layer_spec(i).mlp for i in range(model.config.num_hidden_layers)]
    if any(s != "dense" for s in specs):
        return ("mixture-of-experts layers route tokens data-dependently (top-k, per-expert "
                "groups): they run eager")
    if getattr(model.config, "gemma3", None) is not None:
        return ("Gemma 3's sandwich norms are not the fused add + norm the pieces are cut at: "
                "it runs eager")
    kinds = {(tuple((n, t.shape, t.dtype) for n, t in piece_weights(layer).items()),
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


class PiecewiseForward:
    """The model's forward with compiled pieces; installed on the instance by
    :func:`compile_model` (``model.forward``), ``model.forward.report`` its report."""

    def __init__(self, model: nn.Module, capture_sizes: tuple[int, ...], backend: Any,
                 report: CompileReport, dot_max_tokens: int = DOT_MAX_TOKENS,
                 pack_weights: bool = True) -> None:
        self.model = model
        self.eager = types.MethodType(type(model).forward, model)
        self.sizes = sorted(capture_sizes)
        self.report = report
        self.backend = backend_compiler(backend)
        # dot-product loops are a CPU cure (MKL's sgemm reads weights slower, see dot_linear);
        # on a GPU the library's gemv stays
        self.dot_max_tokens = dot_max_tokens if model.device.type == "cpu" else 0
        self.graphs: dict[tuple[str, int], CapturedGraph] = {}
        self.flat: dict[tuple[str, str], list[list[torch.Tensor]]] = {}  # per call site
        # oneDNN-packed copies of each layer's linear weights, for the pieces above dot size
        self.packs: dict[nn.Module, PackedWeights] | None = None
        if pack_weights and self.sizes[-1] > dot_max_tokens and cannot_pack(model) is None:
            self.packs = {m: PackedWeights(m) for m in (*model.model.layers, model.lm_head)}
            report.packed_bytes = sum(p.nbytes for p in self.packs.values())
        self.step_size = 0  # the capture size of the forward running now
        self.static_for: tuple[Any, str | None] = (None, None)  # (cache, static_refusal)
        self.cuda_graphs: CUDAGraphs | None = None  # set by compile_model on a CUDA device
        # inductor's settings, fixed here (on the caller's thread: graphs may be compiled on
        # a server's engine thread, which does not see this thread's settings)
        self.options = inductor_options(cpp_wrapper=False)
        self.full_options = inductor_options(cpp_wrapper=report.wrapper == "cpp")

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor | None = None,
                 kv_cache: Any = None, logits_indices: torch.Tensor | None = None,
                 **model_inputs: Any) -> torch.Tensor:
        T = input_ids.shape[-1]
        if (not self.report.compiled or model_inputs or kv_cache is None or positions is None
                or input_ids.dim() != 2 or input_ids.shape[0] != 1 or T > self.sizes[-1]):
            if self.report.compiled:
                self.report.eager_forwards += 1
            return self.eager(input_ids, positions, kv_cache, logits_indices, **model_inputs)
        size = self.step_size = self.sizes[bisect.bisect_left(self.sizes, T)]
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

    def _variant(self, size: int) -> str:
        """How a piece of ``size`` tokens computes its linear layers."""
        if size <= self.dot_max_tokens:
            return "dot"  # a batch-1 step reads the weights: dot-product loops
        return "packed" if self.packs is not None else "plain"

    def _sites(self, kind: str) -> list[tuple[nn.Module, ...]]:
        """The modules each call of piece ``kind`` takes its weights from, in call order."""
        m = self.model
        layers = list(m.model.layers)
        if kind.startswith("full"):  # a full graph: the layers, norm, head and embedding
            return [(*layers, m.model.norm, m.lm_head, m.model.embed_tokens)]
        return {"pre": [(layers[0],)], "between": list(zip(layers, layers[1:])),
                "last": [(layers[-1],)], "head": [(m.lm_head,)]}[kind]

    def site_weights(self, kind: str, size: int, i: int = 0) -> list[torch.Tensor]:
        """Call ``i`` of piece ``kind``'s flat weights, in its ``size`` graph's input order
        (built at first use: after ``fuse_model``, which makes the fused tensors)."""
        variant, names = self._variant(size), self.graphs[kind, size].names
        key = kind, variant
        if key not in self.flat:
            self.flat[key] = [[named[n] for n in names] for named in
                              (self._named(modules, variant) for modules in self._sites(kind))]
        return self.flat[key][i]

    def _named(self, modules: tuple[nn.Module, ...], variant: str) -> dict[str, torch.Tensor]:
        """The tensors one call of a piece takes, under the template's names: the modules'
        weights, and with ``variant == "packed"`` their packed copies."""
        named = piece_weights(*modules)
        for j, m in enumerate(modules if variant == "packed" else ()):
            packed = self.packs[m].packed if m in self.packs else {}  # (a norm has none)
            named.update({f"templates.{j}.{n}": t for n, t in packed.items()})
        return named

    def _graph(self, kind: str, size: int, i: int, *args: torch.Tensor) -> Any:
        """Run call ``i`` of piece ``kind`` at ``size``, compiling the piece on first use."""
        if (kind, size) not in self.graphs:
            self._build(kind, size, args)
        return self.graphs[kind, size](self.site_weights(kind, size, i), *args)

    def _build(self, kind: str, size: int, args: tuple, kv_cache: Any = None,
               kernel: bool = False, options: dict[str, Any] | None = None) -> None:
        variant = self._variant(size)
        templates = self._templates(kind)
        for t in templates:
            {"dot": use_dot_products, "packed": use_packed_weights}.get(variant, id)(t)
        if kind.startswith("full"):
            piece = decode_piece(self.model, kv_cache, list(templates), kernel)
        else:
            piece = Piece({"pre": pre_attention, "between": between_attention,
                           "last": last_attention, "head": lm_head}[kind], *templates)
        example = self._named(self._sites(kind)[0], variant)  # the first call's tensors
        weights = {n: example[n] for n in piece_weights(*templates)}
        t0 = time.perf_counter()
        with packed_op_as_library_call() if variant == "packed" else contextlib.nullcontext():
            self.graphs[kind, size] = CapturedGraph(piece, weights, args, self.backend,
                                                    options or self.options)
        self.report.graphs += 1
        if self.step_size in self.report.compile_s:  # built in a step of a compiled size
            self.report.compile_s[self.step_size] += time.perf_counter() - t0

    def _templates(self, kind: str) -> tuple[nn.Module, ...]:
        """Weightless copies (every tensor is a graph input) of the modules a piece runs: layer
        0 once, or twice for the piece between two layers; all of them for a full graph."""
        m = self.model
        if kind.startswith("full"):
            sources = self._sites(kind)[0]
        else:
            source = m.lm_head if kind == "head" else m.model.layers[0]
            sources = (source,) * (2 if kind == "between" else 1)
        return tuple(copy.deepcopy(s).to("meta") for s in sources)

    def _full(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: Any,
              logits_indices: torch.Tensor | None, size: int) -> torch.Tensor | None:
        """A uniform decode step as one full graph (:mod:`labkit.engine.full_graph`); None
        when it runs piecewise (``report.full_reason`` says why)."""
        if self.static_for[0] is not kv_cache:  # once per cache: its backend, dtype, layers
            self.static_for = kv_cache, static_refusal(self.model, kv_cache)
        reason = self.report.full_reason = (step_refusal(self.model, kv_cache)
                                            or self.static_for[1])
        if reason is not None:
            return None
        bucket, args = full_graph_args(self.model, input_ids, positions, kv_cache, size)
        kind = f"full{bucket}/{kv_cache.k_caches[0].shape[0]}"  # the pool's size: its shape
        if (kind, size) not in self.graphs:
            why = kernel_refusal(self.model, kv_cache, size, bucket)
            keys = f"{size} x {bucket * kv_cache.block_size}"
            self.report.full_attention[keys] = KERNEL if why is None else f"loops: {why}"
            try:
                self._build_full(kind, size, args, kv_cache, kernel=why is None)
            except Exception as e:  # noqa: BLE001 - inductor's failures have no common type
                self.report.full_graphs = False
                self.report.full_reason = f"the full graph failed to compile: {e!r:.300}"
                warnings.warn(f"compile=True: {self.report.full_reason}; decode steps run "
                              "piecewise", RuntimeWarning, stacklevel=4)
                return None
        graph, weights = self.graphs[kind, size], self.site_weights(kind, size)
        if self.cuda_graphs is None:
            logits = graph(weights, *args)[0]
        else:  # one CUDA graph per graph and KV pool (its caches are captured as themselves)
            key = (kind, size, args[-1].data_ptr())
            logits = self.cuda_graphs.run(graph, weights, args, step_inputs(self.model), key)[0]
            self.report.cuda_graphs = len(self.cuda_graphs.runners)
        self.report.full_steps += 1
        T = input_ids.shape[1]
        return logits[:T] if logits_indices is None else logits[:T][logits_indices]

    def _build_full(self, kind: str, size: int, args: tuple, kv_cache: Any,
                    kernel: bool) -> None:
        """A full graph with the C++ wrapper when asked; where inductor cannot build that,
        with the Python wrapper, and the report says why (never a silent fallback)."""
        if self.full_options["cpp_wrapper"]:
            try:
                return self._build(kind, size, args, kv_cache, kernel, self.full_options)
            except Exception as e:  # noqa: BLE001 - inductor's failures have no common type
                self.report.wrapper_reason = f"{type(e).__name__}: {str(e)[:200]}"
                self.full_options = self.options
                warnings.warn(f"compile=True: the C++ wrapper failed ({e!r:.200}); full "
                              "graphs use the Python wrapper", RuntimeWarning, stacklevel=5)
        self._build(kind, size, args, kv_cache, kernel, self.options)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: Any,
                 logits_indices: torch.Tensor | None, size: int) -> torch.Tensor:
        m, T = self.model, input_ids.shape[1]
        if int(positions.max()) >= m.config.max_position_embeddings:
            return self.eager(input_ids, positions, kv_cache, logits_indices)  # its error
        if self.packs is not None and size > self.dot_max_tokens and \
                any([p.refresh() for p in self.packs.values()]):  # an in-place update
            self.flat = {k: v for k, v in self.flat.items() if k[1] != "packed"}
        if self.report.full_graphs and is_uniform_decode(kv_cache, T):
            logits = self._full(input_ids, positions, kv_cache, logits_indices, size)
            if logits is not None:
                return logits if logits_indices is not None else logits.unsqueeze(0)
        pad = size - T
        x = m.model.embed_tokens(F.pad(input_ids, (0, pad)))
        pos = F.pad(positions, (0, pad))  # position 0 for the pad rows: any valid one
        cos, sin = m.rope(pos, x.dtype)
        residual = torch.zeros_like(x)  # layer 0's add is x + 0 = x, exactly
        q, k, v, residual = self._graph("pre", size, 0, x, residual, cos, sin)
        layers = m.model.layers
        for i, layer in enumerate(layers):
            out = kv_cache.attend(layer.self_attn.layer_idx, q[:, :T], k[:, :T], v[:, :T],
                                  positions)
            out = F.pad(out, (0, 0, 0, 0, 0, pad))
            if i + 1 < len(layers):
                q, k, v, residual = self._graph("between", size, i, out,
                                                residual, cos, sin)
            else:
                hidden = self._graph("last", size, 0, out, residual)
        x = m.model.norm(hidden[0][:, :T]).reshape(T, -1)
        if logits_indices is not None:
            return self._head(x[logits_indices])
        return self._head(x).unsqueeze(0)  # [1, T, V], the model's shape

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head (the largest weight of a small model): a compiled dot-product piece for
        up to ``dot_max_tokens`` rows (one graph per row count), a matmul above (over the
        packed weight when there is one)."""
        if x.shape[0] > self.dot_max_tokens:
            head = self.model.lm_head
            if self.packs is None:
                return head(x)
            return packed_linear(x, self.packs[head].packed["packed"], head.bias)
        return self._graph("head", x.shape[0], 0, x)[0]


def compile_model(model: nn.Module, capture_sizes: tuple[int, ...] = CAPTURE_SIZES,
                  backend: Any = "inductor", dot_max_tokens: int = DOT_MAX_TOKENS,
                  pack_weights: bool = True, full_graphs: bool = True,
                  wrapper: str = "cpp", cuda_graphs: bool = True,
                  cuda_graph_api: Any = None) -> CompileReport:
    """Install :class:`PiecewiseForward` as ``model.forward`` (in place) and return its report;
    a model that cannot be compiled here keeps its forward, and the report (and a warning)
    say why. A model already compiled returns its existing report. Pieces of up to
    ``dot_max_tokens`` tokens compute their linears as :func:`dot_linear` (0: never); larger
    ones, with ``pack_weights`` on a CPU, as oneDNN matmuls over weights packed once
    (:mod:`labkit.engine.packed_linear`). With ``full_graphs`` a step where every sequence
    decodes one token runs as one graph, attention included (:mod:`labkit.engine.full_graph`);
    without, every step runs piecewise. ``wrapper`` "cpp" calls each full graph's kernels from
    generated C++ (one call, the GIL released: :mod:`labkit.engine.graph_capture`), "python"
    from inductor's Python wrapper. On a CUDA device with ``cuda_graphs`` each full graph is
    also captured as a CUDA graph (:mod:`labkit.engine.cuda_graph`); ``cuda_graph_api``
    replaces torch's CUDA-graph calls, on any device (a test's replay on the CPU)."""
    current = vars(model).get("forward")
    if isinstance(current, PiecewiseForward):
        return current.report
    if not capture_sizes or min(capture_sizes) < 1:
        raise ValueError(f"capture sizes must be positive token counts, got {capture_sizes}")
    if dot_max_tokens < 0:
        raise ValueError(f"dot_max_tokens is a token count (0: never), got {dot_max_tokens}")
    if wrapper not in WRAPPERS:
        raise ValueError(f"wrapper must be one of {WRAPPERS}, got {wrapper!r}")
    report = CompileReport(True, None, backend, sorted(capture_sizes), full_graphs=full_graphs,
                           wrapper=wrapper)
    reason = cannot_compile(model) if backend == "inductor" else None
    if reason is not None:
        report.compiled, report.reason = False, reason
        warnings.warn(f"compile=True: {reason}; running eager", RuntimeWarning, stacklevel=2)
        return report
    if backend == "inductor":
        match_aten_vector_width()
    forward = PiecewiseForward(model, tuple(capture_sizes), backend, report, dot_max_tokens,
                               pack_weights)
    report.cuda_graph_reason = (None if cuda_graph_api is not None and cuda_graphs
                                else cuda_graph_refusal(model.device, cuda_graphs))
    if full_graphs and report.cuda_graph_reason is None:
        forward.cuda_graphs = CUDAGraphs(cuda_graph_api or CUDA_API)
    model.forward = forward
    return report

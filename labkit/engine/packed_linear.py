"""Weights prepacked for oneDNN, for the compiled pieces above one token.

Above one token a decode step's linear layers are real matrix products, and on a CPU their
speed depends on the weight's layout in memory. A BLAS ``sgemm`` call (MKL's, what
``F.linear`` and inductor's ``extern_kernels.mm`` run) takes the weight as a plain row-major
matrix and re-packs panels of it into its blocked layout on every call. oneDNN can pack the
weight *once*, into the blocked layout its kernels read
(``torch.ops.mkldnn._reorder_linear_weight``), and each call then only streams it. TensorRT's
builder and inductor's ``freezing`` do the same ("weight prepacking"; vLLM's CPU backend through
IPEX/oneDNN). ``labkit bench step`` measures what it buys at batch 8 and 32.

Inductor has its own lowering of oneDNN's packed linear, for weights it froze into the graph as
constants. Here the weights are graph *inputs* (one graph serves every layer), so the pieces are
compiled with that lowering set aside (:func:`packed_op_as_library_call`): inductor then calls
the op as it calls a library matmul, and fuses the elementwise work around it as before.

The cost is memory: a packed copy of every linear weight beside the original (the eager paths,
the state dict and weight updates use the original). A weight updated in place
(``LLMEngine.update_weights``) changes its version counter, and :class:`PackedWeights` repacks
it before the next compiled step.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn

from labkit.model.fuse import FusedProjection

_OP = torch.ops.mkldnn._linear_pointwise.default


def cannot_pack(model: nn.Module) -> str | None:
    """Why this model's weights are not prepacked here (None: they are)."""
    if model.device.type != "cpu":
        return "not on a CPU (oneDNN's packed CPU kernels)"
    if model.dtype != torch.float32:
        return f"{model.dtype} weights (packing is used for float32)"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (mkldnn)"
    return None


def pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [out, in] in oneDNN's blocked layout (an opaque ``torch._mkldnn`` tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None
                  ) -> torch.Tensor:
    """``x @ weight.T (+ bias)`` with the weight prepacked by :func:`pack`."""
    y = _OP(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return y.view(*x.shape[:-1], packed.shape[0])


class _PackedLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)


class _PackedFusedProjection(FusedProjection):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return packed_linear(x, self.packed, self.bias).split(self.sizes, dim=-1)


_SWAP = {nn.Linear: _PackedLinear, FusedProjection: _PackedFusedProjection}
# the projections fuse_model folds into one (labkit.model.fuse): not run once fused, not packed
_FUSED_INTO = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
               "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}


def _packable(module: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(name, module) of each plain linear or fused projection the forward runs."""
    mods = dict(module.named_modules())
    for name, m in mods.items():
        parent, _, leaf = name.rpartition(".")
        if type(m) in _SWAP and not hasattr(mods[parent], _FUSED_INTO.get(leaf, " ")):
            yield name, m


def use_packed_weights(template: nn.Module) -> nn.Module:
    """Make a (weightless) template's linears and fused projections read a ``packed`` buffer,
    in place; the compiled piece gets each layer's packed weights under those names."""
    for _, m in list(_packable(template)):
        m.__class__ = _SWAP[type(m)]
        m.register_buffer("packed", torch.empty(m.weight.shape, device="meta"),
                          persistent=False)
    return template


class PackedWeights:
    """The packed copy of each linear weight of some modules (named as
    :func:`use_packed_weights`' buffers), repacked when the original changes in place."""

    def __init__(self, module: nn.Module) -> None:
        self.sources = {f"{name}.packed" if name else "packed": m.weight
                        for name, m in _packable(module)}
        self.versions = {n: w._version for n, w in self.sources.items()}
        self.packed = {n: pack(w) for n, w in self.sources.items()}

    def refresh(self) -> bool:
        """Repack every weight updated since it was packed; True if any was."""
        stale = [n for n, w in self.sources.items() if w._version != self.versions[n]]
        for n in stale:
            self.packed[n], self.versions[n] = pack(self.sources[n]), self.sources[n]._version
        return bool(stale)

    @property
    def nbytes(self) -> int:
        return sum(w.numel() * w.element_size() for w in self.sources.values())


@contextmanager
def packed_op_as_library_call() -> Iterator[None]:
    """While compiling: inductor without its lowering of oneDNN's packed linear (which expects
    a packed weight frozen into the graph), so it calls the op as an opaque library call."""
    from torch._inductor import lowering

    saved = lowering.lowerings.pop(_OP, None)
    try:
        yield
    finally:
        if saved is not None:
            lowering.lowerings[_OP] = saved

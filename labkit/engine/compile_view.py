"""What inductor generated for a compiled piece: its output code, captured instead of printed.

``compile=True`` (:mod:`labkit.engine.piecewise`) hands each piece of a layer to inductor, and
the question a learner asks next is *what did it make of it?* Inductor answers in its "output
code": one Python module per compiled graph, the wrapper that calls library GEMMs
(``extern_kernels.mm``: inductor does not write its own matmuls on a CPU) and the kernels it
generated for everything between them, C++ with ``at::vec`` SIMD (and OpenMP pragmas above one
thread) on a CPU, Triton on a GPU. Each kernel is named after the ATen ops fused into it:
``cpp_fused_add_mean_mul_pow_rsqrt_0`` is the residual add and the whole RMSNorm in one loop
nest, where eager PyTorch runs five operators and writes four intermediate tensors.

``TORCH_LOGS=output_code`` (or ``torch._logging.set_logs(output_code=True)``) prints that code
to stderr. :func:`capture_output_code` listens to the same log, inductor's ``output_code``
artifact logger, while a block runs and keeps each module's text instead of printing it: a
handler of its own at DEBUG, and the logger's state put back on exit. Inductor logs the code on
a fresh compile and on an FX-graph-cache hit alike, so a second run (a warm
``/tmp/torchinductor_<user>``) shows the same code. :func:`parse_output_code` splits a module
into its kernels and library calls.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

# name = async_compile.cpp_pybinding([types], r'''<C++>''') or .triton('name', '''<py>''')
_KERNEL = re.compile(r"^(?P<name>\w+) = async_compile\.(?P<kind>cpp_pybinding|triton)\("
                     r"[^\n]*?'''\n(?P<source>.*?)'''", re.S | re.M)
# a library GEMM (extern_kernels.mm) or an op inductor calls as it is (an ATen fallback such as
# oneDNN's packed linear, labkit.engine.packed_linear): "mm", "mkldnn._linear_pointwise"
_LIBRARY_CALL = re.compile(r"\bextern_kernels\.(\w+)\(|= torch\.ops\.(\w+\.\w+)\.\w+\(")
_PREFIX = re.compile(r"^(cpp|triton_(poi|red|per|tem|mix_order_red))_fused_")
_HEADER = "Output code: \n"


@dataclass
class GeneratedKernel:
    """One kernel inductor wrote: ``name`` as in the wrapper, ``language`` "C++" or "Triton",
    ``source`` its code."""

    name: str
    language: str
    source: str

    @property
    def fused_ops(self) -> list[str]:
        """The op names inductor built the kernel's name from (``cpp_fused_add_mean_1`` ->
        ["add", "mean"]); ATen names with an underscore (``_unsafe_view``) split in two, so
        read them as a hint, not a census."""
        core = re.sub(r"_\d+$", "", _PREFIX.sub("", self.name))
        return [p for p in core.split("_") if p]

    def head(self, lines: int = 30) -> str:
        """The kernel's first ``lines`` lines (a fused loop nest is long to print whole)."""
        text = self.source.splitlines()
        more = f"\n... ({len(text) - lines} more lines)" if len(text) > lines else ""
        return "\n".join(text[:lines]) + more


@dataclass
class OutputCode:
    """One compiled graph's output module: its text, its kernels, and the library calls
    (``extern_kernels.mm``, ``addmm``, ``bmm``, ...) the wrapper makes between them."""

    source: str
    kernels: list[GeneratedKernel] = field(default_factory=list)
    library_calls: list[str] = field(default_factory=list)


def parse_output_code(text: str) -> OutputCode:
    """Split inductor's output module ``text`` into kernels and library calls. Raises
    ValueError for text that is not an output module (no ``def call`` / ``call =`` in it)."""
    if not isinstance(text, str):
        raise TypeError(f"output code is a str, got {type(text).__name__}")
    text = text.removeprefix(_HEADER)
    if "def call(" not in text and "call = " not in text:
        raise ValueError("not inductor output code: no `call` entry point in it "
                         f"(starts {text[:60]!r})")
    kernels = [GeneratedKernel(m["name"], "C++" if m["kind"] == "cpp_pybinding" else "Triton",
                               m["source"]) for m in _KERNEL.finditer(text)]
    return OutputCode(text, kernels, [a or b for a, b in _LIBRARY_CALL.findall(text)])


class _Keep(logging.Handler):
    """Keeps each distinct output module logged (the same graph is logged once per cache hit)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: dict[str, None] = {}

    def emit(self, record: logging.LogRecord) -> None:
        msg = record.getMessage()
        if msg.startswith(_HEADER):
            self.seen.setdefault(msg, None)


def output_code_logger() -> logging.Logger:
    """Inductor's ``output_code`` artifact logger (what ``TORCH_LOGS=output_code`` turns on);
    torch raises ValueError if a version renames the artifact."""
    return torch._logging.getArtifactLogger("torch._inductor.codecache", "output_code")


@contextmanager
def capture_output_code() -> Iterator[list[OutputCode]]:
    """``with capture_output_code() as codes: <compile something>``: afterwards ``codes`` holds
    one :class:`OutputCode` per distinct graph inductor compiled (or loaded from its cache)
    inside the block, in order. Nothing is printed, and the logger is left as it was."""
    log = output_code_logger()
    keep, level = _Keep(), log.level
    codes: list[OutputCode] = []
    log.addHandler(keep)
    log.setLevel(logging.DEBUG)
    try:
        yield codes
    finally:
        log.removeHandler(keep)
        log.setLevel(level)
        codes += [parse_output_code(text) for text in keep.seen]

"""What ``compile=True`` did, for the learner and the bench: :class:`CompileReport`.

One report per compiled model (``llm.compile_report``, ``model.forward.report``): whether it
compiled or why not, the seconds each capture size took, how decode steps ran (full graphs,
with which attention and which wrapper, or piecewise and why). :mod:`labkit.engine.piecewise`
fills it in as it builds graphs; ``labkit bench step`` writes it into its JSON.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from labkit.engine.full_graph import KERNEL


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
    graphs: int = 0  # graphs built: one per piece kind and capture size, never one per layer
    packed_bytes: int = 0  # the oneDNN-packed copies of the linear weights (0: not packed)
    full_graphs: bool = True  # uniform decode steps as one graph each (labkit.engine.full_graph)
    full_steps: int = 0  # steps that ran as a full graph
    full_reason: str | None = None  # why the last decode step ran piecewise (None: it did not)
    # each full graph's attention ("<size> x <bucket keys>"): KERNEL, or why inductor's loops
    full_attention: dict[str, str] = field(default_factory=dict)
    # the full graphs' kernel-calling code: "cpp" (one GIL-free call) or "python"; the reason
    # when "cpp" was asked and inductor could not build it
    wrapper: str = "cpp"
    wrapper_reason: str | None = None
    # CUDA graphs captured from the full graphs (labkit.engine.cuda_graph), or why none are
    cuda_graphs: int = 0
    cuda_graph_reason: str | None = None

    @property
    def total_s(self) -> float:
        return sum(self.compile_s.values())

    def __str__(self) -> str:
        if not self.compiled:
            return f"not compiled ({self.reason}); the model runs eager"
        done = ", ".join(f"{n}: {s:.1f} s" for n, s in sorted(self.compile_s.items()))
        why = self.full_reason or 'compile_mode="piecewise"'
        kernel = sum(a == KERNEL for a in self.full_attention.values())
        attn = (f" (attention: the C++ decode kernel in {kernel} of "
                f"{len(self.full_attention)} graphs)" if self.full_attention else "")
        wrapper = (f"; C++ wrapper failed ({self.wrapper_reason})" if self.wrapper_reason
                   else f", {'C++' if self.wrapper == 'cpp' else 'Python'} wrapper")
        full = (f"; decode steps as full graphs{attn}{wrapper}"
                if self.full_graphs and not self.full_reason
                else f"; decode steps piecewise ({why})")
        cuda = f"; {self.cuda_graphs} CUDA graphs" if self.cuda_graphs else ""
        packed = (f"; linear weights packed for oneDNN (+{self.packed_bytes / 2**20:.1f} MiB)"
                  if self.packed_bytes else "")
        return (f"{self.backend}: {len(self.compile_s)} of {len(self.capture_sizes)} "
                f"sizes compiled in {self.total_s:.1f} s ({done or 'none yet'})"
                f"{full}{cuda}{packed}")

"""Where a step's time goes: a profiler that times each phase of every engine step.

On a CPU, and for small models on any device, a decode step is mostly *overhead*: scheduling,
building the input tensors, Python between PyTorch ops, sampling, detokenising. vLLM V1 was
redesigned around that overhead and SGLang hides it behind the forward ("overlap scheduling");
before trying a cure, measure. ``StepProfiler`` splits each ``LLMEngine.step`` into the phases
the engine runs, in order:

=============  ======================================================================
schedule       ``Scheduler.schedule``: admission, budgets, block allocation
block_ops      ``Executor.apply_block_ops``: swaps and copy-on-write block copies
prepare        ``ModelRunner.forward`` minus the model: packing ids, positions, slots
forward        the model's forward (and inside it, per layer: attention, MLP, norms;
               the LM head)
sample         ``ModelRunner.sample``: argmax or the sampler
update         ``Scheduler.update_from_output``: append tokens, stop checks, frees
detokenize     ``LLMEngine._step_output``: incremental detokenisation per sequence
trace          the trace observer's record of the step
other          the step's wall time not inside any phase: the engine's own Python
=============  ======================================================================

each with wall time (``perf_counter``) and CPU time (``process_time``, all threads: CPU above
wall means torch's threads worked in parallel; below it, the process waited).

Why wrapping, not hooks in the engine: ``attach`` replaces those methods on the *instances*
(and each profiled step registers forward hooks on the model's modules, removed as it ends);
``detach`` puts the originals back. With
the profiler off the engine runs exactly the code it runs without one: nothing to check per
step, so "profiling off" costs nothing. ``torch.profiler.record_function`` ranges name every
phase too, so a ``torch.profiler`` run around ``generate`` shows them; ``export_chrome_trace``
writes this profiler's own timeline for chrome://tracing or https://ui.perfetto.dev.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

PHASES = ("schedule", "block_ops", "prepare", "forward", "sample", "update", "detokenize",
          "trace", "other")
LAYER_PARTS = ("attention", "mlp", "norm", "lm_head")


@dataclass
class StepProfile:
    """One engine step: wall and CPU seconds per phase and per layer part, and its size."""

    index: int
    start: float  # perf_counter at the step's start
    wall: float = 0.0
    cpu: float = 0.0
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    phases_cpu: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    layers: dict[str, float] = field(default_factory=lambda: dict.fromkeys(LAYER_PARTS, 0.0))
    num_seqs: int = 0
    num_tokens: int = 0
    events: list[tuple[str, str, float, float]] = field(default_factory=list)  # cat, name, t, d

    def as_dict(self) -> dict[str, Any]:
        return {"index": self.index, "wall": self.wall, "cpu": self.cpu,
                "phases": dict(self.phases), "phases_cpu": dict(self.phases_cpu),
                "layers": dict(self.layers), "num_seqs": self.num_seqs,
                "num_tokens": self.num_tokens}


class StepProfiler:
    """``StepProfiler().attach(engine)``; run it; read ``steps`` / ``summary()``; ``detach()``.

    ``layers=True`` also times attention, MLP, norms and the LM head inside the forward (a
    forward hook pair per module: a few microseconds each, so it is off when only phases are
    wanted)."""

    def __init__(self, layers: bool = True, max_steps: int = 100_000) -> None:
        self.layers = layers
        self.steps: deque[StepProfile] = deque(maxlen=max_steps)  # the newest, bounded
        self._num_steps = 0
        self._restore: list[Callable[[], None]] = []
        self._cur: StepProfile | None = None
        self._model: torch.nn.Module | None = None
        self._model_t: list[tuple[float, float]] = []  # (wall, CPU) of each model forward
        self._t0 = time.perf_counter()

    # ---- attaching --------------------------------------------------------------------------
    @property
    def attached(self) -> bool:
        return bool(self._restore)

    def attach(self, engine: Any) -> StepProfiler:
        """Wrap ``engine``'s phases (see the module doc). Idempotent per profiler."""
        if self.attached:
            return self
        self._wrap(engine, "step", self._step)
        self._phase(engine.scheduler, "schedule", "schedule")
        self._phase(engine.scheduler, "update_from_output", "update")
        self._phase(engine.executor, "apply_block_ops", "block_ops")
        self._phase(engine, "_step_output", "detokenize")
        self._phase(engine.observer, "on_step", "trace")
        runner = getattr(engine.executor, "runner", None)
        if runner is None:  # speculative decoding wraps the real executor
            runner = getattr(getattr(engine.executor, "target", None), "runner", None)
        if runner is not None:
            self._phase(runner, "forward", "prepare")  # the model's share is moved out below
            self._phase(runner, "sample", "sample")
            self._model = runner.model
        return self

    def detach(self) -> None:
        """Put every original method back and remove the hooks."""
        while self._restore:
            self._restore.pop()()

    def _wrap(self, obj: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        orig = getattr(obj, name)
        had = name in vars(obj)  # an instance attribute already (rare): restore it, not delete
        setattr(obj, name, make(orig))

        def restore() -> None:
            if had:
                setattr(obj, name, orig)
            else:
                delattr(obj, name)

        self._restore.append(restore)

    def _phase(self, obj: Any, name: str, phase: str) -> None:
        if obj is None or not hasattr(obj, name):
            return
        label = f"labkit::{phase}"

        def make(orig: Callable) -> Callable:
            def timed(*a: Any, **k: Any) -> Any:
                cur = self._cur
                if cur is None:
                    return orig(*a, **k)
                before = len(self._model_t)
                w0, c0 = time.perf_counter(), time.process_time()
                with torch.profiler.record_function(label):
                    try:
                        result = orig(*a, **k)
                        if phase == "schedule":
                            cur.num_seqs = len(getattr(result, "scheduled", ()))
                        return result
                    finally:
                        w, c = time.perf_counter() - w0, time.process_time() - c0
                        if phase == "prepare":  # runner.forward = prepare + the model
                            model = self._model_t[before:]
                            cur.phases["forward"] += sum(m[0] for m in model)
                            cur.phases_cpu["forward"] += sum(m[1] for m in model)
                            w -= sum(m[0] for m in model)
                            c -= sum(m[1] for m in model)
                        cur.phases[phase] += w
                        cur.phases_cpu[phase] += c
                        cur.events.append(("phase", phase, w0, w))
            return timed

        self._wrap(obj, name, make)

    def _step(self, orig: Callable) -> Callable:
        def step(*a: Any, **k: Any) -> Any:
            # the model's hooks live only while a profiled step runs (outside the step's own
            # timing): a model shared with other engines, or kept after this one, carries none
            hooks = self._hook_model(self._model) if self._model is not None else []
            self._model_t.clear()
            cur = StepProfile(self._num_steps, time.perf_counter())
            self._cur, c0 = cur, time.process_time()
            try:
                outs = orig(*a, **k)
            finally:
                cur.wall = time.perf_counter() - cur.start
                cur.cpu = time.process_time() - c0
                self._cur = None
                for h in hooks:
                    h.remove()
                cur.phases["other"] = max(0.0, cur.wall - sum(cur.phases.values()))
                cur.phases_cpu["other"] = max(0.0, cur.cpu - sum(cur.phases_cpu.values()))
            # an idle step (nothing scheduled) is not a step; nor is async scheduling's last
            # call, which only returns the step before it (no forward ran: num_tokens 0)
            if cur.num_tokens or (outs and self._model is None):
                self.steps.append(cur)
                self._num_steps += 1
            return outs
        return step

    def _hook_model(self, model: torch.nn.Module) -> list[Any]:
        """Time the whole forward (pre/post hooks on the model) and, with ``layers``, each
        attention, MLP, norm and the LM head."""
        def top_pre(_m: Any, args: Any) -> None:
            self._fwd_t0, self._fwd_c0 = time.perf_counter(), time.process_time()
            if self._cur is not None and args and isinstance(args[0], torch.Tensor):
                self._cur.num_tokens += int(args[0].numel())

        def top_post(*_: Any) -> None:
            d = time.perf_counter() - self._fwd_t0
            self._model_t.append((d, time.process_time() - self._fwd_c0))
            if self._cur is not None:
                self._cur.events.append(("phase", "forward", self._fwd_t0, d))

        handles = [model.register_forward_pre_hook(top_pre),
                   model.register_forward_hook(top_post)]
        if self.layers:
            for name, mod in model.named_modules():
                part = _layer_part(name)
                if part is not None:
                    handles += self._time_module(mod, part)
        return handles

    def _time_module(self, mod: torch.nn.Module, part: str) -> list[Any]:
        starts: list[float] = []

        def pre(*_: Any) -> None:
            starts.append(time.perf_counter())

        def post(*_: Any) -> None:
            t0 = starts.pop()
            d = time.perf_counter() - t0
            if self._cur is not None:
                self._cur.layers[part] += d
                self._cur.events.append(("layer", part, t0, d))

        return [mod.register_forward_pre_hook(pre), mod.register_forward_hook(post)]

    # ---- reading ----------------------------------------------------------------------------
    def summary(self, skip: int = 1) -> dict[str, Any]:
        """Totals over the steps after the first ``skip`` (warm-up): seconds and share of the
        steps' wall time per phase and per layer part, and the mean step."""
        steps = list(self.steps)[skip:] or list(self.steps)
        wall = sum(s.wall for s in steps) or 1e-12
        phases = {p: sum(s.phases[p] for s in steps) for p in PHASES}
        layers = {p: sum(s.layers[p] for s in steps) for p in LAYER_PARTS}
        return {"num_steps": len(steps), "wall_s": wall, "cpu_s": sum(s.cpu for s in steps),
                "mean_step_ms": 1e3 * wall / max(1, len(steps)),
                "phases_s": phases, "share": {p: v / wall for p, v in phases.items()},
                "layers_s": layers, "layer_share_of_forward": {
                    p: v / (phases["forward"] or 1e-12) for p, v in layers.items()}}

    def export_chrome_trace(self, path: str | Path) -> Path:
        """The steps as a Chrome trace (``chrome://tracing``, ui.perfetto.dev): a track for the
        steps, one for the phases, one for the layer parts; times in microseconds."""
        tid = {"step": 1, "phase": 2, "layer": 3}
        ev: list[dict[str, Any]] = [
            {"ph": "M", "name": "thread_name", "pid": 1, "tid": t, "args": {"name": n}}
            for n, t in tid.items()]
        for s in self.steps:
            ev.append(_event("step", f"step {s.index}", s.start - self._t0, s.wall, 1,
                             {"seqs": s.num_seqs, "tokens": s.num_tokens}))
            ev += [_event(cat, name, t - self._t0, d, tid[cat]) for cat, name, t, d in s.events]
        p = Path(path)
        p.write_text(json.dumps({"traceEvents": ev, "displayTimeUnit": "ms"}))
        return p


def _event(cat: str, name: str, t: float, d: float, tid: int,
           args: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": t * 1e6,
            "dur": d * 1e6, **({"args": args} if args else {})}


def _layer_part(name: str) -> str | None:
    """Which part of a decoder a module is, from its Hugging Face name (None: not timed)."""
    last = name.rsplit(".", 1)[-1]
    if last == "self_attn":
        return "attention"
    if last == "mlp":
        return "mlp"
    if last in ("input_layernorm", "post_attention_layernorm") or name == "model.norm":
        return "norm"
    if name == "lm_head":
        return "lm_head"
    return None

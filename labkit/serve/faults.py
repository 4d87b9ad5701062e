"""Fault injection for the triage lab: ``LABKIT_FAULT=NAME labkit serve ...``.

The triage exercise (``labkit.exercises.triage``) asks "the service suddenly got slow: why?"
of a real server with one real mechanism broken. Three of its faults are plain settings (a
tiny ``--num-blocks``, ``--no-enable-chunked-prefill``, a low ``--rate-limit-rps``); the
three here are things no flag expresses, so the server reads this environment variable once
at start and injects them at two seams of ``labkit/serve`` (never in the engine core):

- ``cpu-hog``: ``launcher.main`` starts one busy-spinning process per core beside the server
  once its engine is built
  (a runaway sidecar, a noisy neighbour). From outside: every latency up, nothing in
  ``/metrics`` explains it; ``top`` shows a process that is not the server burning CPU. Each
  hog exits within ~50 ms of the server (it watches its parent), so none outlives it.
- ``gc-storm``: the API process (``launcher.main``) and the engine process
  (``engine_core._core_main``) skip the startup heap freeze and set
  ``gc.set_threshold(1, 1, 1)``: a collection on nearly every container allocation, each one
  walking the unfrozen heap of torch and the app. From outside: ``python_gc_collections_total``
  in ``/metrics`` climbs by orders of magnitude per request.
- ``slow-tokenizer``: ``engine_core.build_engine`` wraps the tokenizer so each ``decode``
  burns ``SLOW_DECODE_S`` of CPU (a pure-Python tokenizer, a regex gone quadratic). From
  outside: ITL up at every batch size; the step profiler's ``detokenize`` phase dominates.

An unknown name fails the server's start with :class:`UnknownFaultError` (a typo would
otherwise run a healthy server and the lab would lie).
"""

from __future__ import annotations

import atexit
import gc
import os
import subprocess
import sys
import time
from typing import Any

FAULT_ENV = "LABKIT_FAULT"
FAULTS = ("cpu-hog", "gc-storm", "slow-tokenizer")
SLOW_DECODE_S = 0.005  # CPU seconds each decode call burns under slow-tokenizer
HOG_ARG = "labkit-fault-cpu-hog"  # in the hog's command line, so top names it
_HOG_CODE = ("import os,sys,time\nppid=os.getppid()\nwhile os.getppid()==ppid:\n"
             " t=time.perf_counter()\n while time.perf_counter()-t<0.05: pass\n")


class UnknownFaultError(ValueError):
    """``LABKIT_FAULT`` names no fault this server can inject."""


def active_fault() -> str | None:
    """The fault ``LABKIT_FAULT`` asks for (None: unset or empty); raises on an unknown name."""
    name = os.environ.get(FAULT_ENV, "").strip()
    if not name:
        return None
    if name not in FAULTS:
        raise UnknownFaultError(f"{FAULT_ENV}={name!r}: the server injects only {FAULTS} "
                                "(the other triage faults are server flags)")
    return name


def gc_storm() -> None:
    """Collect on nearly every allocation, over the whole (unfrozen) heap."""
    gc.unfreeze()
    gc.set_threshold(1, 1, 1)


def gc_state(_engine: Any = None) -> tuple[tuple[int, ...], int]:
    """(``gc.get_threshold()``, ``gc.get_freeze_count()``) of the process it runs in: picklable,
    so ``AsyncLLM.call(gc_state)`` reads an engine process's collector settings."""
    return gc.get_threshold(), gc.get_freeze_count()


def start_cpu_hogs(n: int | None = None) -> list[subprocess.Popen]:
    """``n`` (default: one per core) processes that spin until their parent exits."""
    procs = [subprocess.Popen([sys.executable, "-c", _HOG_CODE, HOG_ARG])
             for _ in range(n or os.cpu_count() or 1)]

    def stop() -> None:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(5)

    atexit.register(stop)
    return procs


def inject_api_process() -> str | None:
    """``launcher.main``'s seam, before the app starts: returns the fault (the caller skips
    its heap freeze under gc-storm)."""
    fault = active_fault()
    if fault == "gc-storm":
        gc_storm()
    elif fault == "cpu-hog":
        start_cpu_hogs()
    return fault


def inject_engine_process() -> None:
    """``engine_core._core_main``'s seam, after its heap freeze."""
    if active_fault() == "gc-storm":
        gc_storm()


class SlowTokenizer:
    """A tokenizer whose ``decode`` burns ``delay`` CPU seconds first; all else delegated."""

    def __init__(self, inner: Any, delay: float = SLOW_DECODE_S) -> None:
        self.inner, self.delay = inner, delay

    def decode(self, *a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        while time.perf_counter() - t < self.delay:  # CPU work, not a sleep: as real ones
            pass
        return self.inner.decode(*a, **k)

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # during unpickling, before __init__ ran
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __reduce__(self) -> tuple:
        return SlowTokenizer, (self.inner, self.delay)


def maybe_slow_tokenizer(tok: Any) -> Any:
    """``build_engine``'s seam: the tokenizer, wrapped under ``LABKIT_FAULT=slow-tokenizer``."""
    return SlowTokenizer(tok) if active_fault() == "slow-tokenizer" else tok

"""The bench harness every benchmark (and every timing a notebook shows) shares: an argument
parser, greedy sampling params, a timed call (CPU and wall), a JSON-and-chart writer, a table
printer, and :func:`compare`, which times variants side by side until their ratio is stable
and says plainly when the machine was too busy to trust it."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from labkit.paths import RESULTS_DIR

T = TypeVar("T")


def bench_parser(name: str, description: str) -> argparse.ArgumentParser:
    """The flags every ``labkit bench NAME`` accepts: ``--quick`` and ``--json PATH``."""
    p = argparse.ArgumentParser(prog=f"labkit bench {name}", description=description)
    p.add_argument("--quick", action="store_true", help="small sizes, finishes in about a minute")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    return p


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


# The machine's load when this run began (this module is imported as a benchmark starts, before
# it adds load of its own). A number measured while other work ran is not the number the README
# may quote: tests/bench/test_result_provenance.py reads this from every committed JSON.
_START = {"load_average_at_start": _loadavg(), "started": time.time()}


def mark_start() -> None:
    """Start a new run's record (a notebook or a caller running several benchmarks)."""
    _START.update(load_average_at_start=_loadavg(), started=time.time())


def cpu_model() -> str:
    """The CPU's marketing name (``/proc/cpuinfo``): BLAS paths and vector widths differ by
    CPU, and a reader comparing runs needs to know whose numbers they are."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def environment() -> dict[str, Any]:
    """Where the numbers came from: always stored beside results. The load averages (1, 5 and
    15 minutes) at the start and end of the run say whether the machine was otherwise idle:
    with ``cores`` cores, a 1-minute load at start under ``cores`` is the lab's bar."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "threads": torch.get_num_threads(),
        "load_average_at_start": list(_START["load_average_at_start"]),
        "load_average_at_end": _loadavg(),
        "run_s": round(time.time() - _START["started"], 1),
    }


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> None:
    """Print rows of dicts as an aligned text table (floats to 4 significant digits)."""
    if not rows:
        print("(no rows)")
        return
    cols = list(columns or rows[0].keys())

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def write_json(path: str | Path | None, payload: dict[str, Any]) -> None:
    """Write ``payload`` (plus the environment) to ``path`` if one was given."""
    if not path:
        return
    payload = {**payload, "environment": payload.get("environment", environment())}
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    print(f"wrote {p}")


def load_result(name: str) -> dict[str, Any]:
    """A committed benchmark result, ``datasets/results/<name>.json`` (what the README quotes),
    so notebooks can print it beside the learner's own run."""
    path = RESULTS_DIR / f"{name}.json"
    if not path.exists():
        known = sorted(p.stem for p in RESULTS_DIR.glob("*.json"))
        raise FileNotFoundError(f"no committed result {name!r} in {RESULTS_DIR}; known: {known}")
    return json.loads(path.read_text())


def greedy_params(max_tokens: int, **overrides: Any):
    """The sampling every benchmark uses: greedy, exactly ``max_tokens`` tokens (``ignore_eos``),
    no detokenization (transformers' ``generate`` returns ids only, so neither side pays for
    text). Greedy makes every engine path comparable token for token with the reference."""
    from labkit.engine.sampling_params import SamplingParams

    kw = {"temperature": 0.0, "max_tokens": max_tokens, "ignore_eos": True, "detokenize": False}
    return SamplingParams(**{**kw, **overrides})


def _sync(device: str | None) -> None:
    if device and str(device).startswith("cuda"):
        torch.cuda.synchronize()


@dataclass(frozen=True)
class Timing:
    """Wall and process-CPU seconds of one timed call.

    ``load`` = wall / CPU: about 1 for a single-threaded run on an idle core; 2 means this process
    got half a core (other processes ran in between). CPU time counts only this process's work,
    so on a shared machine it is the steadier measure of *cost*."""

    wall_s: float
    cpu_s: float

    @property
    def load(self) -> float:
        return self.wall_s / max(self.cpu_s, 1e-9)


def timed(fn: Callable[..., T], *args: Any, device: str | None = None,
          cpu_clock: Callable[[], float] = time.process_time, **kwargs: Any) -> tuple[T, Timing]:
    """Call ``fn(*args, **kwargs)``; return its result and a :class:`Timing`. On CUDA the device
    is synchronized before and after, so queued kernels are counted where they run.
    ``cpu_clock``: ``time.process_time`` (all threads) or ``time.thread_time`` (this one)."""
    _sync(device)
    t0, c0 = time.perf_counter(), cpu_clock()
    out = fn(*args, **kwargs)
    _sync(device)
    return out, Timing(time.perf_counter() - t0, cpu_clock() - c0)


def write_results(path: str | Path | None, payload: dict[str, Any],
                  chart: Callable[[dict[str, Any], Path], None] | None = None) -> None:
    """Write the JSON (as :func:`write_json`) and, if ``chart`` is given, its plotly chart beside
    it (``PATH`` with ``.html``). A missing plotly skips only the chart."""
    write_json(path, payload)
    if not path or chart is None:
        return
    try:
        chart(payload, Path(path).with_suffix(".html"))
    except ImportError:
        print("plotly is not installed (pip install labkit[lab]); chart skipped")


Variant = Callable[[], Callable[[], Any]]
"""``prepare() -> work``: ``prepare`` builds what a run needs (an engine, its warm-up) untimed,
``work()`` is the part timed. A fresh ``prepare`` per round keeps rounds independent (an engine
with prefix caching would otherwise hit on its own earlier rounds)."""


@dataclass
class Comparison:
    """Per-round speed-ups of each variant over ``baseline`` (baseline CPU s / variant CPU s)
    and every run's :class:`Timing`; see :func:`compare` for why these and when to trust them."""

    baseline: str
    speedups: dict[str, list[float]]
    timings: dict[str, list[Timing]]
    results: dict[str, Any]
    max_spread: float
    max_load: float
    time_cap_hit: bool = False

    @property
    def rounds(self) -> int:
        return len(self.timings[self.baseline])

    def speedup(self, name: str) -> float:
        """Median over rounds: one round disturbed by a burst of other work cannot move it."""
        return statistics.median(self.speedups[name])

    def spread(self, name: str) -> float:
        """Median absolute deviation of the rounds' speed-ups, relative to their median."""
        s, m = self.speedups[name], self.speedup(name)
        return statistics.median(abs(x - m) for x in s) / m

    def wall_speedup(self, name: str) -> float:
        pairs = zip(self.timings[self.baseline], self.timings[name])
        return statistics.median(b.wall_s / max(v.wall_s, 1e-9) for b, v in pairs)

    @property
    def load(self) -> float:
        """Median wall / CPU over every timed run (1 = a core of our own)."""
        return statistics.median(t.load for ts in self.timings.values() for t in ts)

    @property
    def problems(self) -> list[str]:
        """Why the numbers should not be trusted (empty when they can be)."""
        out = []
        if self.load > self.max_load:
            out.append(f"the machine was too busy: this process got {1 / self.load:.0%} of a "
                       f"core (wall time {self.load:.1f}x its CPU time, bound "
                       f"{self.max_load:.1f}x)")
        noisy = [f"{n} ±{self.spread(n):.0%}" for n in self.speedups
                 if self.spread(n) > self.max_spread]
        if noisy:
            out.append(f"the rounds disagree ({', '.join(noisy)}; bound ±{self.max_spread:.0%} "
                       f"over {self.rounds} rounds)")
        return out

    @property
    def trusted(self) -> bool:
        return not self.problems

    def describe(self, name: str, what: str | None = None) -> str:
        """One sentence for a notebook: the number with its spread, or plainly why there is
        none. ``what`` names the ratio (default ``"NAME / BASELINE"``)."""
        what = what or f"{name} / {self.baseline}"
        if not self.trusted:
            return (f"{what}: no trustworthy number on this run - {'; '.join(self.problems)}. "
                    "Close other programs (or let the widgets above finish drawing) and rerun "
                    "this cell.")
        return (f"{what} = {self.speedup(name):.2f}x (median of {self.rounds} interleaved "
                f"rounds, ±{self.spread(name):.0%}, process CPU time; wall clock "
                f"{self.wall_speedup(name):.2f}x)")


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Run the body with ``n`` torch threads (``None``: leave as is), then restore."""
    old = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def compare(variants: dict[str, Variant], baseline: str | None = None, *, min_rounds: int = 3,
            max_rounds: int = 9, max_seconds: float = 30.0, max_spread: float = 0.10,
            max_load: float = 8.0, threads: int | None = 1, warmup: bool = True) -> Comparison:
    """Time ``variants`` side by side until their speed-ups over ``baseline`` are stable.

    How, and why each choice:

    * **Process CPU time**, not wall time, is the measure. On a shared machine (a 2-core laptop
      whose browser is drawing the widgets of the previous cell) wall time mostly measures the
      other processes; this process's CPU seconds count only its own work. Wall time is kept
      beside it: ``wall / CPU`` says how much of a core the process got.
    * **One torch thread** (``threads=1``) while measuring. With several threads, a thread
      descheduled by another process makes the rest spin at the next barrier, and the spinning
      is charged as CPU time; one thread's CPU time is its work alone. (A 5 M-parameter model
      gains little from more threads anyway.) With one thread the clock is this *thread's* CPU
      time: CPU bursts of the process's other threads (OpenMP workers spin-waiting after an
      earlier parallel region, a server loop left by an earlier cell) land on whichever run they
      happen to overlap.
    * **Interleaved rounds**: every round runs every variant once, in alternating order
      (A B, then B A), and each round gives one speed-up per variant from the same few seconds
      of machine state, so slow phases of the machine hit both sides of a ratio.
    * **Until stable**: after ``min_rounds``, stop once every speed-up's spread (median absolute
      deviation / median) is under half of ``max_spread``; stop anyway at ``max_rounds`` or
      after ``max_seconds``. The **median** round is reported.
    * **Say so instead of a wrong number**: the result is *untrusted* when the spread stays
      above ``max_spread`` (default ±10%: the effects the notebooks show are 1.3x and more) or
      the median ``wall / CPU`` exceeds ``max_load`` (default 8: this process got under an
      eighth of a core). CPU-time ratios held within 10% up to a load of 13 on the lab's 2-core
      test machine (tests/bench/test_busy_machine.py), but every run's CPU cost itself grew by a
      third there (cache refills after each switch): past that the machine is not measuring
      what a learner's idle machine would. :meth:`Comparison.describe` then prints why and what
      to do.
    """
    names = list(variants)
    baseline = baseline or names[0]
    if baseline not in variants or len(names) < 2:
        raise ValueError(f"compare needs at least two variants including the baseline "
                         f"{baseline!r}; got {names}")
    timings: dict[str, list[Timing]] = {n: [] for n in names}
    t_start = time.perf_counter()
    c = Comparison(baseline, {n: [] for n in names if n != baseline}, timings, {},
                   max_spread, max_load)
    clock = time.thread_time if threads == 1 else time.process_time
    with torch_threads(threads):
        if warmup:
            for n in names:
                variants[n]()()
        _run_rounds(c, variants, t_start, min_rounds, max_rounds, max_seconds, clock)
    return c


def _run_rounds(c: Comparison, variants: dict[str, Variant], t_start: float, min_rounds: int,
                max_rounds: int, max_seconds: float, clock: Callable[[], float]) -> None:
    """Interleaved rounds into ``c`` until every speed-up is stable or a cap is hit: each round
    runs every variant once (A B, then B A), so a slow phase hits both sides of a ratio."""
    names, baseline, timings = list(variants), c.baseline, c.timings
    for r in range(max_rounds):
        for n in names if r % 2 == 0 else names[::-1]:
            work = variants[n]()
            c.results[n], t = timed(work, cpu_clock=clock)
            timings[n].append(t)
        for n in c.speedups:
            c.speedups[n].append(timings[baseline][-1].cpu_s / max(timings[n][-1].cpu_s, 1e-9))
        if r + 1 >= min_rounds:
            if all(c.spread(n) <= c.max_spread / 2 for n in c.speedups):
                break
            if time.perf_counter() - t_start > max_seconds:
                c.time_cap_hit = True
                break

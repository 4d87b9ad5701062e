"""The notebooks' measurements under a busy machine (issue 19: Run All printed 0.07x while the
browser drew the previous cell's widgets).

Decision, and why: under load every ratio :func:`labkit.bench.common.compare` calls trusted
must stay within ``TOLERANCE`` (±25%) of the unloaded run; an untrusted one is allowed, because
the helper then prints no number, only why (and the busy branch is checked to say so). ±25% keeps
every conclusion the notebooks draw (continuous batching's 1.3-1.4x beats static; speculative
decoding is about 1x on CPU; prefix caching's several-fold TTFT cut), while a wall-clock ratio
under the same hog moves by far more. The hog is one busy-looping process per core, bounded in
time, killed at the end."""

import os
import subprocess
import sys

import pytest

import labkit
from labkit.bench.batching import compare_batching, make_requests
from labkit.bench.prefix import compare_ttft
from labkit.bench.spec import compare_spec

TOLERANCE = 0.25
pytestmark = pytest.mark.slow


def _measurements(model, tok) -> dict[str, tuple]:
    prompts, max_tokens = make_requests(tok, num_requests=8, output_mean=8, output_max=32)
    ids = [tok.encode("def fibonacci(n):")]
    specs = {"ngram": {"method": "ngram", "num_speculative_tokens": 4}}
    kw = {"max_seconds": 8.0}
    return {
        "continuous / static": (compare_batching((model, tok), prompts, max_tokens, 4, **kw),
                                "continuous"),
        "ngram / plain": (compare_spec(model, ids, 16, specs, **kw), "ngram"),
        "TTFT off / on": (compare_ttft(model, tok, num_prompts=2, **kw), "cache on"),
    }


def _hog(seconds: float) -> list[subprocess.Popen]:
    code = f"import time\nend = time.time() + {seconds}\nwhile time.time() < end:\n    pass\n"
    return [subprocess.Popen([sys.executable, "-c", code]) for _ in range(os.cpu_count() or 2)]


def _quiet_then_busy(model, tok) -> list[tuple]:
    quiet = _measurements(model, tok)
    hogs = _hog(120)
    try:
        busy = _measurements(model, tok)
    finally:
        for h in hogs:
            h.kill()
            h.wait()
    return [(label, q, busy[label][0], name) for label, (q, name) in quiet.items()]


class Unloaded(Exception):
    """The hog did not load the machine (the busy run got a whole core): inconclusive."""


def _drifted(rows: list[tuple]) -> list[str]:
    """Checks every row; returns the trusted pairs whose ratios differ by more than TOLERANCE.
    Raises :class:`Unloaded` when a busy run's wall/CPU says it was not slowed down."""
    drifted = []
    for label, q, b, name in rows:
        line = (f"{label}: quiet {q.speedup(name):.2f}x load {q.load:.1f} {q.trusted}, "
                f"busy {b.speedup(name):.2f}x load {b.load:.1f} {b.trusted}")
        print(line)
        if b.load <= 1.2:
            raise Unloaded(line)
        if q.trusted and b.trusted:
            if abs(b.speedup(name) / q.speedup(name) - 1) > TOLERANCE:
                drifted.append(line)
        else:
            assert "no trustworthy number" in (q if not q.trusted else b).describe(name)
    return drifted


def _attempt(model, tok) -> list[str] | None:
    """The drifted rows of one quiet/busy pair, or None when the hog did not load the machine."""
    try:
        return _drifted(_quiet_then_busy(model, tok))
    except Unloaded as e:
        print(f"inconclusive pair: {e}")
        return None


def test_notebook_ratios_hold_or_are_flagged_under_a_cpu_hog():
    """One retry of the quiet/busy pair: under ``pytest -n 2`` the "quiet" run shares the two
    cores with the other worker's tests, whose load changes from second to second (one CI run
    read continuous/static 0.78x quiet against 1.06x busy, both tight). A real regression (a
    hog that moves trusted ratios) fails both attempts. A pair whose busy run was not slowed
    (wall/CPU at most 1.2: the scheduler gave it a whole core beside the hogs, seen once in CI)
    tests nothing: it is retried once, and skipped as inconclusive if it happens again."""
    model, tok = labkit.load_pretrained("labkit-tiny")
    first = _attempt(model, tok)
    if first is None:
        first = _attempt(model, tok)
    if first is None:
        pytest.skip("inconclusive: twice the hog did not load the machine")
    if first:
        second = _attempt(model, tok)
        if second is None:
            pytest.skip(f"inconclusive: drifted ({first}), then the hog did not load the machine")
        assert not second, f"drifted twice: {first} then {second}"

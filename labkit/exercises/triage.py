"""Exercise: "the service suddenly got slow: how do you investigate?", as a runnable lab.

``Triage(seed)`` picks one hidden fault (``labkit.exercises.triage_faults``: a CPU hog, a GC
storm, a KV pool far too small, chunked prefill off under long prompts, a rate limit far too
low, a slow tokenizer), starts a real ``labkit serve`` child process with it, and runs a fixed
short load against it (``labkit.bench.serve_client``: short code prompts and two long ones,
Poisson arrivals). What a learner may then look at is what an on-call engineer has:

- ``metrics``: the server's ``/metrics`` after the load, parsed (sums over labels);
- ``latency``: the client's view, p50 / p99 TTFT and ITL, status codes;
- ``log``: the server's output;
- ``top``: CPU seconds per process of the server's process tree during the load;
- ``profile()``: the engine's step profile (``labkit.engine.profiler``) of the same load on
  an engine with the server's settings, run here (what a profiler on a quiet staging box
  shows: a fault of the *environment* leaves it healthy).

``check(answer)`` answers at once: right, with the evidence that pointed to it; wrong, with
the evidence of this run that rules the answer out ("labkit:num_preemptions_total is 0, so
the KV pool is not thrashing"). Under ``LABKIT_INJECT_SOLUTIONS=1`` a ``None`` answer is
replaced by the fault (CI runs the notebook headless). ``stop()`` (or leaving a ``with``
block) stops the server and its children.
"""

from __future__ import annotations

import os
import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from labkit.exercises.triage_faults import (
    EXPLAIN,
    FAULTS,
    INJECT,
    MEANING,
    SIGNATURES,
    engine_kwargs,
)

MODEL = "labkit-tiny"
API_KEY = "triage-key"
# the engine in a thread of the server: one process to start (faster), and /metrics' GC and CPU
# counters then cover the engine too
BASE_ARGS = ("--api-key", API_KEY, "--max-num-seqs", "8", "--engine-threads", "1",
             "--engine-mode", "thread")
NUM_SHORT, NUM_LONG, LONG_TOKENS, MAX_TOKENS, RATE = 8, 2, 800, 16, 20.0


class UnknownFaultError(ValueError):
    """A fault name the lab does not have (an answer or a ``fault=`` with a typo)."""


@dataclass
class TriageResult:
    answer: str
    correct: bool
    message: str


def _fault_name(name: str) -> str:
    if name not in FAULTS:
        raise UnknownFaultError(f"{name!r} is not one of the lab's faults: {', '.join(FAULTS)}")
    return name


def pick_fault(seed: int | None) -> str:
    """The hidden fault for ``seed`` (None: the system's randomness)."""
    return random.Random(seed).choice(FAULTS)


def load_requests() -> list[Any]:
    """The fixed load: ``NUM_SHORT`` code prompts and ``NUM_LONG`` prompts of ``LONG_TOKENS``
    token ids each, in a fixed shuffled order (seed 0)."""
    from labkit.bench.serve_client import BenchRequest, make_requests
    from labkit.model.loader import open_checkpoint

    reqs = make_requests(NUM_SHORT, MAX_TOKENS, api_key=API_KEY)
    tok = open_checkpoint(MODEL)[1]
    ids = tok.encode("".join(str(r.prompt) for r in reqs) * 40)[:LONG_TOKENS]
    if len(ids) < LONG_TOKENS:
        raise RuntimeError(f"the long prompt has {len(ids)} < {LONG_TOKENS} tokens")
    reqs += [BenchRequest(ids[i:] + ids[:i], MAX_TOKENS, API_KEY) for i in range(NUM_LONG)]
    random.Random(0).shuffle(reqs)
    return reqs


def process_tree_cpu(root: int) -> dict[int, tuple[str, str, float]]:
    """``{pid: (role, name, cpu seconds so far)}`` for ``root`` and its descendants: role
    "api" (the server), "engine" (an engine process, with ``--engine-mode process``), "helper"
    (multiprocessing's resource tracker) or "other" (anything else the server started)."""
    import psutil

    out: dict[int, tuple[str, str, float]] = {}
    try:
        top = psutil.Process(root)
        procs = [top, *top.children(recursive=True)]
    except psutil.NoSuchProcess:
        return out
    for p in procs:
        try:
            argv = p.cmdline()
            t = p.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        cmd = " ".join(argv)
        role = ("api" if p.pid == root else "engine" if "spawn_main" in cmd
                else "helper" if "resource_tracker" in cmd else "other")
        name = {"api": "labkit serve", "engine": "labkit engine core",
                "helper": "resource tracker"}.get(role, argv[-1][-40:] if argv else "?")
        out[p.pid] = (role, name, t.user + t.system)
    return out


class Triage:
    """One hidden fault in a live server, a load run against it, and the evidence.

    ``Triage(seed)`` picks the fault with ``random.Random(seed)`` (``seed=None``: a fresh pick
    each time); ``fault=`` names it instead (tests). The server stays up until ``stop()``."""

    def __init__(self, seed: int | None = None, fault: str | None = None,
                 startup_timeout: float = 120.0) -> None:
        from labkit.serve.process import ServerProcess

        self._fault = _fault_name(fault) if fault else pick_fault(seed)
        flags, env_fault = INJECT[self._fault]
        self.server = ServerProcess(MODEL, [*BASE_ARGS, *flags],
                                    startup_timeout=startup_timeout)
        self.server.env.pop("LABKIT_FAULT", None)
        if env_fault:
            self.server.env["LABKIT_FAULT"] = env_fault
        self.requests = load_requests()
        self.num_requests = len(self.requests)
        self._profile: dict[str, Any] | None = None
        self.server.start()
        try:
            self._run_load()
        except BaseException:
            self.stop()
            raise

    def _run_load(self) -> None:
        import httpx

        from labkit.bench.serve_client import load, summarize
        from labkit.serve.metrics import parse_metrics

        before = process_tree_cpu(self.server.pid)
        with ThreadPoolExecutor(1) as pool:  # its own event loop: a notebook's already runs
            results, self.duration = pool.submit(load, self.server.url, MODEL, self.requests,
                                                 None, rate=RATE, seed=0).result()
        after = process_tree_cpu(self.server.pid)
        self.top = sorted(({"pid": pid, "role": role, "name": name,
                            "cpu_s": cpu - before.get(pid, (0, 0, 0.0))[2]}
                           for pid, (role, name, cpu) in after.items()),
                          key=lambda p: -p["cpu_s"])
        self.results = results
        self.latency = summarize(results, self.duration)
        self.metrics_text = httpx.get(self.server.url + "/metrics", timeout=10).text
        self.metrics = parse_metrics(self.metrics_text)

    @property
    def log(self) -> str:
        """The server's output so far."""
        return self.server.output()

    def latency_table(self) -> dict[str, float]:
        """p50 / p99 TTFT and ITL in ms, and the requests that failed."""
        keys = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms")
        return {**{k: self.latency[k] for k in keys}, "failed": self.latency["failed"]}

    def profile(self) -> dict[str, Any]:
        """The step profile of the load's requests on an engine with the server's settings
        (cached): the profiler's summary plus ``max_step_tokens`` and ``num_preemptions``."""
        if self._profile is None:
            self._profile = _profile_engine(self._fault, self.requests)
        return self._profile

    def evidence(self, fault: str) -> tuple[bool, str]:
        """``fault``'s signature in this run: (present, the numbers that say so)."""
        return SIGNATURES[_fault_name(fault)](self)

    def check(self, answer: str | None) -> TriageResult:
        """Right: the evidence that pointed to it. Wrong: the evidence that rules it out."""
        if answer is None:
            if os.environ.get("LABKIT_INJECT_SOLUTIONS") != "1":
                msg = ("✎ not answered yet: set my_answer to one of " + ", ".join(FAULTS) +
                       " and run the cell again")
                print(msg)
                return TriageResult("", False, msg)
            answer = self._fault
        answer = _fault_name(str(answer).strip())
        present, shown = self.evidence(answer)
        if answer == self._fault:
            msg = f"✓ {answer}: {shown}; {EXPLAIN[answer]}"
            ok = True
        elif not present:
            msg = f"✗ not {answer}: {shown}, so {MEANING[answer]}"
            ok = False
        else:  # cannot happen while the signatures are specific; say so if one is not
            msg = f"✗ not {answer}, although {shown}: look for a second signature"
            ok = False
        print(msg)
        return TriageResult(answer, ok, msg)

    def reveal(self) -> str:
        """The hidden fault (for after the exercise, and for tests)."""
        return self._fault

    def stop(self) -> None:
        self.server.stop()

    def __enter__(self) -> Triage:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def _profile_engine(fault: str, requests: list[Any]) -> dict[str, Any]:
    """``requests`` through an engine built as the server builds it under ``fault`` (its
    tokenizer wrapped under slow-tokenizer), with the step profiler attached."""
    from labkit.engine.profiler import StepProfiler
    from labkit.engine.sampling_params import SamplingParams
    from labkit.model.loader import open_checkpoint
    from labkit.serve.engine_core import build_engine
    from labkit.serve.faults import SlowTokenizer

    tok = open_checkpoint(MODEL)[1]
    if fault == "slow-tokenizer":
        tok = SlowTokenizer(tok)
    eng, _, _ = build_engine(MODEL, tokenizer=tok, max_num_seqs=8, **engine_kwargs(fault))
    prof = StepProfiler(layers=False).attach(eng)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, r in enumerate(requests):
        ids = r.prompt if isinstance(r.prompt, list) else tok.encode(r.prompt)
        eng.add_request(str(i), None, sp, prompt_token_ids=ids)
    while eng.has_unfinished_requests():
        eng.step()
    prof.detach()
    out = prof.summary(skip=0)
    out["max_step_tokens"] = max(s.num_tokens for s in prof.steps)
    out["num_preemptions"] = eng.stats().get("num_preemptions", 0)
    return out

"""The triage lab's faults: how each is injected, and the evidence that shows (or rules out) it.

Each fault is one real mechanism in a real ``labkit serve``, as an on-call engineer meets it:

- ``cpu-hog`` (``LABKIT_FAULT``: busy processes beside the server): every latency up, nothing
  in ``/metrics`` explains it; first check ``top``: a process that is not the server burns CPU.
- ``gc-storm`` (``LABKIT_FAULT``: ``gc.set_threshold(1)``, heap unfrozen): first check
  ``python_gc_collections_total`` in ``/metrics``: thousands of collections per request.
- ``small-kv-pool`` (``--num-blocks`` far below the load): ``labkit:num_preemptions`` > 0 and
  ``kv_cache_usage_perc`` near 1.
- ``no-chunked-prefill`` (``--no-enable-chunked-prefill`` under long prompts): ITL spikes; the
  step profile shows a step holding more tokens than the chunk budget (decodes stall for it).
- ``low-rate-limit`` (``--rate-limit-rps`` far below the load): status codes first: 429s, and
  ``labkit:request_rejected`` counts them.
- ``slow-tokenizer`` (``LABKIT_FAULT``: each ``decode`` burns CPU): the step profile's
  ``detokenize`` phase takes a large share of the step.

A signature is a function of the evidence returning ``(present, what it shows)``: the checker
accepts an answer whose signature is present and rejects one whose signature is absent, citing
the numbers of *this* run. The thresholds sit several times away from both sides (measured
here: a healthy run collects ~50 times per request, a storm ~3,000; the profile's detokenize
share is ~1% healthy and ~25% slowed), so no timing noise flips a verdict.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

FAULTS = ("cpu-hog", "gc-storm", "small-kv-pool", "no-chunked-prefill", "low-rate-limit",
          "slow-tokenizer")
CHUNK_BUDGET = 512  # the engine's max_num_batched_tokens with chunked prefill (config default)
NUM_BLOCKS_SMALL = 56  # one 800-token prompt fits (51 blocks of 16), two never do
# how each fault reaches the server: extra flags and the LABKIT_FAULT value (labkit.serve.faults)
INJECT: dict[str, tuple[tuple[str, ...], str | None]] = {
    "cpu-hog": ((), "cpu-hog"),
    "gc-storm": ((), "gc-storm"),
    "small-kv-pool": (("--num-blocks", str(NUM_BLOCKS_SMALL)), None),
    "no-chunked-prefill": (("--no-enable-chunked-prefill",), None),
    "low-rate-limit": (("--rate-limit-rps", "0.5"), None),
    "slow-tokenizer": ((), "slow-tokenizer"),
}
GC_PER_REQUEST = 200  # collections per request above which the collector is the problem
HOG_RATIO = 0.25  # a process beside the server using more than this x the server's CPU-seconds
DETOKENIZE_SHARE = 0.1  # of the profiled steps' wall time


def engine_kwargs(fault: str) -> dict[str, Any]:
    """The engine settings the server runs with under ``fault`` (for ``Triage.profile``)."""
    return {"small-kv-pool": {"num_blocks": NUM_BLOCKS_SMALL},
            "no-chunked-prefill": {"enable_chunked_prefill": False}}.get(fault, {})


def _preemptions(ev: Any) -> tuple[bool, str]:
    n = ev.metrics.get("labkit:num_preemptions_total", 0.0)
    return n > 0, f"labkit:num_preemptions_total is {n:.0f}"


def _rate_limited(ev: Any) -> tuple[bool, str]:
    n = ev.metrics.get("labkit:request_rejected_total", 0.0)
    s429 = ev.latency["status_counts"].get("429", 0)
    return n > 0 or s429 > 0, (f"the client got {s429} responses with status 429 and "
                               f"labkit:request_rejected_total is {n:.0f}")


def _gc(ev: Any) -> tuple[bool, str]:
    n = ev.metrics.get("python_gc_collections_total", 0.0)
    per = n / max(1, ev.num_requests)
    return per > GC_PER_REQUEST, (f"python_gc_collections_total is {n:.0f}, {per:.0f} per "
                                  f"request (a storm is > {GC_PER_REQUEST} per request)")


def _hog(ev: Any) -> tuple[bool, str]:
    server = sum(p["cpu_s"] for p in ev.top if p["role"] != "other")
    others = [p for p in ev.top if p["role"] == "other"]
    busiest = max(others, key=lambda p: p["cpu_s"], default=None)
    if busiest is None:
        return False, (f"top shows no process beside the server, which used {server:.2f} "
                       f"CPU-s in the {ev.duration:.1f} s load")
    return busiest["cpu_s"] > HOG_RATIO * server, (
        f"top's busiest process beside the server (pid {busiest['pid']}, {busiest['name']}) "
        f"used {busiest['cpu_s']:.2f} CPU-s in the {ev.duration:.1f} s load, the server "
        f"{server:.2f}")


def _big_step(ev: Any) -> tuple[bool, str]:
    n = ev.profile()["max_step_tokens"]
    return n > CHUNK_BUDGET, (f"the profile's largest step held {n} tokens (the chunked-prefill"
                              f" budget is {CHUNK_BUDGET})")


def _detokenize(ev: Any) -> tuple[bool, str]:
    share = ev.profile()["share"]["detokenize"]
    return share > DETOKENIZE_SHARE, (f"detokenize is {share:.0%} of the profiled steps' wall "
                                      "time")


SIGNATURES: dict[str, Callable[[Any], tuple[bool, str]]] = {
    "cpu-hog": _hog, "gc-storm": _gc, "small-kv-pool": _preemptions,
    "no-chunked-prefill": _big_step, "low-rate-limit": _rate_limited,
    "slow-tokenizer": _detokenize,
}
MEANING = {  # what the signature being absent rules out, after "so"
    "cpu-hog": "nothing beside the server is competing for the cores",
    "gc-storm": "the garbage collector is not what stalls the server",
    "small-kv-pool": "the KV pool is not thrashing",
    "no-chunked-prefill": "long prompts are being chunked and decodes do not stall behind them",
    "low-rate-limit": "no request is being throttled",
    "slow-tokenizer": "detokenisation is not where the step's time goes",
}
EXPLAIN = {  # why the signature pointed at the fault, after the evidence
    "cpu-hog": "the cores are shared with a process that is not the server: every phase of "
               "every step waits for CPU (field check: top / htop, then the cgroup's CPU limit "
               "and throttling)",
    "gc-storm": "the collector runs on nearly every allocation and walks the unfrozen startup "
                "heap each time (field check: gc.get_stats(), py-spy dump; cure: "
                "gc.freeze() after startup, default thresholds)",
    "small-kv-pool": "running sequences are evicted and recomputed because the KV pool cannot "
                     "hold the batch (field check: kv_cache_usage_perc near 1 with preemptions "
                     "rising; cure: more blocks, fewer max-num-seqs)",
    "no-chunked-prefill": "a whole long prompt is prefilled in one step and every running "
                          "decode waits for it: ITL spikes (cure: chunked prefill, a token "
                          "budget per step)",
    "low-rate-limit": "the service is refusing requests, not slow at them (field check: status "
                      "codes before latencies; cure: the limit, or the client's retry budget)",
    "slow-tokenizer": "the engine's forward is fine; its Python around it is not (field check: "
                      "a step profile or py-spy; cure: a fast tokenizer, detokenising off "
                      "the step)",
}

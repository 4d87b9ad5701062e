"""Prometheus metrics with vLLM's meanings under a ``labkit:`` prefix.

What pages an operator at 3 a.m. is queueing (``num_requests_waiting`` growing), memory
pressure (``kv_cache_usage_perc`` near 1 with ``num_preemptions`` rising) and the latencies
users feel (TTFT and inter-token latency histograms). The names follow vLLM's
(``vllm:num_requests_running`` -> ``labkit:num_requests_running`` ...), so dashboards carry over:

- gauges, read from ``engine.stats()`` after every step: requests running / waiting / swapped,
  KV-cache usage (used blocks / all blocks, 0..1), requests the engine holds state for;
- counters: prefix-cache queries and hits (tokens), preemptions, prompt and generation tokens,
  finished requests by finish reason (``request_success``: one per HTTP request, however many
  choices it has) and finished sequences by finish reason (``sequence_success``: one per choice,
  ``n`` x prompts per request), rejections (429/503) by reason, timeouts by kind, aborts by
  reason;
- with a KV connector (``--kv-offload-*``), per tier (``tier`` label: device, cpu, disk):
  blocks hit, blocks loaded, bytes loaded and stored, evictions (counters), bytes held (gauge);
- histograms (seconds): TTFT, inter-token latency, end-to-end latency and queue time. The
  engine's public API does not say when a request was first scheduled, so queue time here is
  arrival to the start of the step that produced its first token (equal to vLLM's queue time
  when the prompt is prefilled in one chunk; longer by the earlier chunks otherwise).

- the API process's own health, as every Prometheus client exports it: garbage collections
  by generation (``python_gc_collections_total``, ``python_gc_objects_collected_total``) and
  CPU seconds / memory (``process_cpu_seconds_total``, ``process_resident_memory_bytes``; on
  Linux). A storm of collections or a CPU share that falls while latency climbs shows here.

Each server owns its own ``CollectorRegistry``, so several servers (tests) live in one process.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    GCCollector,
    Histogram,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

P = "labkit:"
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4,
               0.5, 0.75, 1.0, 2.5, 5.0)
KV_CONNECTOR_COUNTERS = {  # engine.stats()["kv_connector"][tier] key -> help
    "hits": "KV blocks a new request found in this tier instead of computing them",
    "loads": "KV blocks copied from this tier into the device pool",
    "bytes_loaded": "Bytes copied from this tier into the device pool",
    "bytes_stored": "Bytes written to this tier",
    "evictions": "KV blocks this tier dropped (CPU: spilled to disk) to make room",
    "corrupt": "Files that failed their checksum (dropped and recomputed)",
}
KV_TRANSFER_COUNTERS = {  # engine.stats()["kv_connector"]["push" | "receive"] key -> help
    "requests": "Requests whose KV a prefill instance pushed (or tried to)",
    "frames": "KV transfers a decode instance accepted",
    "blocks": "KV blocks pushed / received",
    "bytes": "KV bytes pushed / received",
    "failed": "Pushes that failed (decode instance gone, refused, timed out)",
    "refused": "Transfers a decode instance refused (malformed, incompatible, oversize)",
}


class _EngineCollector:
    """Gauges and engine-owned counters, read from the AsyncLLM's latest stats snapshot at
    scrape time (the engine thread refreshes it after every step; nothing here touches the
    engine)."""

    def __init__(self, llm: Any, model: str) -> None:
        self.llm, self.model = llm, model

    def collect(self):  # noqa: ANN201 - prometheus_client's protocol
        s, lab = self.llm.stats, ["model_name"]
        gauges = {
            "num_requests_running": ("Requests in the running batch", s.get("num_running", 0)),
            "num_requests_waiting": ("Requests waiting to be scheduled",
                                     s.get("num_waiting", 0) + s.get("num_pending", 0)),
            "num_requests_swapped": ("Sequences swapped out to the CPU pool",
                                     s.get("num_swapped", 0)),
            "kv_cache_usage_perc": ("KV-cache usage: used blocks / all blocks (1 = full)",
                                    s.get("num_used_blocks", 0) / max(s.get("num_blocks", 1), 1)),
            "num_requests_in_flight": ("Requests the server holds (queued or running)",
                                       self.llm.num_in_flight),
            "num_requests_held": ("Requests the engine keeps state for (live, and finished ones "
                                  "not yet forgotten): flat in a healthy server",
                                  s.get("num_requests", 0)),
        }
        for name, (doc, v) in gauges.items():
            g = GaugeMetricFamily(P + name, doc, labels=lab)
            g.add_metric([self.model], float(v))
            yield g
        counters = {
            "prefix_cache_queries": ("Prompt tokens looked up in the prefix cache",
                                     s.get("prefix_query_tokens", 0)),
            "prefix_cache_hits": ("Prompt tokens found in the prefix cache",
                                  s.get("prefix_hit_tokens", 0)),
            "num_preemptions": ("Preemptions (recompute or swap) since start",
                                s.get("num_preemptions", 0)),
        }
        for name, (doc, v) in counters.items():
            c = CounterMetricFamily(P + name, doc, labels=lab)
            c.add_metric([self.model], float(v))
            yield c
        yield from self._kv_connector(s.get("kv_connector") or {})

    def _kv_connector(self, tiers: dict[str, dict[str, int]]):  # noqa: ANN202
        """``engine.stats()["kv_connector"]`` (the offloading connector's tiers), by tier."""
        if not tiers:
            return
        for key, doc in KV_CONNECTOR_COUNTERS.items():
            c = CounterMetricFamily(P + "kv_connector_" + key, doc, labels=["model_name", "tier"])
            for tier, counts in tiers.items():
                if key in counts:
                    c.add_metric([self.model, tier], float(counts[key]))
            yield c
        g = GaugeMetricFamily(P + "kv_connector_bytes_used", "Bytes a KV connector tier holds",
                              labels=["model_name", "tier"])
        for tier, counts in tiers.items():
            if "bytes_used" in counts:
                g.add_metric([self.model, tier], float(counts["bytes_used"]))
        yield g
        for key, doc in KV_TRANSFER_COUNTERS.items():  # the p2p connector (P/D), by direction
            c = CounterMetricFamily(P + "kv_transfer_" + key, doc,
                                    labels=["model_name", "direction"])
            for direction in ("push", "receive"):
                if key in tiers.get(direction, {}):
                    c.add_metric([self.model, direction], float(tiers[direction][key]))
            yield c



class ServerMetrics:
    def __init__(self, llm: Any, model: str) -> None:
        self.registry = r = CollectorRegistry()
        self.model = model
        r.register(_EngineCollector(llm, model))
        GCCollector(registry=r)  # python_gc_collections_total...: the API process's collector
        ProcessCollector(registry=r)  # process_cpu_seconds_total, memory: the API process
        m = ["model_name"]
        self.prompt_tokens = Counter(P + "prompt_tokens", "Prefill tokens of admitted requests",
                                     m, registry=r)
        self.generation_tokens = Counter(P + "generation_tokens", "Tokens generated", m,
                                         registry=r)
        self.request_success = Counter(
            P + "request_success", "Requests finished, by finish reason: one per HTTP request "
            "(a request whose choices ended differently counts as length if any choice was "
            "cut by max_tokens or the context, else stop)", m + ["finished_reason"],
            registry=r)
        self.sequence_success = Counter(
            P + "sequence_success", "Sequences (choices) finished, by finish reason: n per "
            "prompt of each finished request", m + ["finished_reason"], registry=r)
        self.rejected = Counter(P + "request_rejected", "Requests refused before admission, "
                                "by reason (queue_full, rate_limit, draining)", m + ["reason"],
                                registry=r)
        self.timeouts = Counter(P + "request_timeout", "Requests dropped by a timeout, by kind "
                                "(queue, request)", m + ["kind"], registry=r)
        self.aborts = Counter(P + "request_aborted", "Requests aborted, by reason: in the "
                              "engine (disconnect, cancel, timeout, step_error, shutdown) or "
                              "before "
                              "admission, the client gone while its body was being read "
                              "(disconnect_reading_body: never accepted)", m + ["reason"],
                              registry=r)
        self.accepted = Counter(P + "request_accepted", "Requests admitted to the engine", m,
                                registry=r)
        self.errors = Counter(P + "request_errors", "Responses with an error status, by status",
                              m + ["status"], registry=r)
        self.ttft = Histogram(P + "time_to_first_token_seconds", "Arrival to first token",
                              m, buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(P + "inter_token_latency_seconds", "Gap between consecutive "
                             "output chunks of a request", m, buckets=ITL_BUCKETS, registry=r)
        self.e2e = Histogram(P + "e2e_request_latency_seconds", "Arrival to finish", m,
                             buckets=LATENCY_BUCKETS, registry=r)
        self.queue = Histogram(P + "request_queue_time_seconds", "Arrival to the start of "
                               "the step that produced its first token", m,
                               buckets=LATENCY_BUCKETS, registry=r)

    def on_step(self, stats: dict, outputs: list) -> None:
        """Engine-thread hook: count generated tokens as the steps make them (aborted
        requests' tokens count too, as vLLM's counter does)."""
        n = sum(len(o.new_token_ids) for o in outputs)
        if n:
            self.generation_tokens.labels(self.model).inc(n)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text -> {sample name: value}, summed over labels (a dashboard's view)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out

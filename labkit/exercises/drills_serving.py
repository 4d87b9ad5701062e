"""Drill bank, part 3: serving in production — streaming, rate limiting, GPU sharing, releases,
gateways, autoscaling, failover, monitoring, multi-tenancy, overlap scheduling. Data only."""

from __future__ import annotations

from labkit.exercises.drills_core import d

SERVING = [
    d("sse", "streaming",
      "How are tokens streamed to clients, and what must happen when a client disconnects?",
      "OpenAI-compatible servers send Server-Sent Events over HTTP: one 'data: {json}' line and "
      "a blank line per chunk, then 'data: [DONE]'. Each chunk is flushed as soon as the engine "
      "step yields tokens. On disconnect the server must notice (the write fails or the framework "
      "cancels the handler) and abort the request in the engine, which frees every KV block it "
      "held; otherwise abandoned requests keep decoding and starve live ones.",
      """
      import json
      from labkit.kv.block_pool import BlockPool
      pool = BlockPool(num_blocks=8)
      def stream(tokens):
          blocks = [pool.allocate()[0] for _ in range(2)]
          try:
              for t in tokens:
                  yield f"data: {json.dumps({'token': t})}\\n\\n"
              yield "data: [DONE]\\n\\n"
          finally:  # runs on normal end AND when the consumer goes away
              for b in blocks:
                  pool.free(b)
      events = stream(["def", " f", "(", "):"])
      print(next(events), next(events), sep="")
      assert pool.num_free == 6
      events.close()  # the client disconnected after two events
      print("free blocks after disconnect:", pool.num_free)
      assert pool.num_free == 8
      """),
    d("structured-mask", "structured-outputs",
      "A client asks for JSON matching a schema. How does the server guarantee the output "
      "parses, what does it cost per step, and why is it harder than checking characters?",
      "The server constrains decoding, it does not retry: the schema is compiled to a grammar "
      "once per request (and cached), and at every step the grammar's current state gives the "
      "set of vocabulary tokens that keep the text inside the language; every other token's "
      "logit is set to -inf before sampling, for greedy and sampled rows alike, and the "
      "grammar advances with each accepted token. When the object is complete only end-of-text "
      "stays allowed, so the request stops through the ordinary EOS check. The hard part is "
      "that the model emits byte-level BPE tokens, not characters: one token can close a string "
      "and open the next key ('\":'), or stop halfway through a number, so the allowed set is "
      "computed per token by walking each token's bytes through the grammar; xgrammar "
      "precomputes most of this per grammar state so a step costs a bitmask fill (a fraction "
      "of a millisecond per constrained row) beside the forward. With speculative decoding "
      "each verify row is masked in the state after the drafts before it, and a draft the "
      "grammar rejects is cut. Common wrong answer: 'generate, then validate and retry'.",
      """
      import labkit
      from labkit.engine.sampling_params import StructuredOutputsParams
      from labkit.engine.structured_output import StructuredOutputManager
      model, tok = labkit.load_pretrained("labkit-tiny")
      manager = StructuredOutputManager(tok, model.config.vocab_size, model.config.eos_token_ids)
      schema = {"type": "object", "properties": {"age": {"type": "integer"}},
                "required": ["age"]}
      proc = manager.logits_processor_factory(
          StructuredOutputsParams(json=schema, disable_any_whitespace=True))()
      for piece in ['{"', 'age', '": ', '4', '2', '}']:
          allowed = int(proc.allowed().sum())
          print(f"{allowed:5} of {model.config.vocab_size} tokens allowed, then {piece!r}")
          proc.accept(tok.encode(piece, add_special_tokens=False))
      print("after the object:", int(proc.allowed().sum()), "token allowed (end of text)")
      assert int(proc.allowed().sum()) == len(model.config.eos_token_ids)
      """),
    d("rate-limit", "rate-limiting",
      "How do you rate-limit an LLM API, and why count tokens rather than requests?",
      "A token bucket per key: capacity B, refilled at r per second; a request spends its cost "
      "and is rejected (HTTP 429 with Retry-After) or queued when the bucket is short. Requests "
      "differ in cost by 1000x (a 10-token question versus a 50k-token document), so limits are "
      "set on tokens per minute as well as requests per minute, and the refill rate is sized "
      "from what the fleet can actually serve.",
      """
      class TokenBucket:
          def __init__(self, rate, capacity):
              self.rate, self.capacity, self.level, self.t = rate, capacity, capacity, 0.0
          def allow(self, now, cost):
              self.level = min(self.capacity, self.level + (now - self.t) * self.rate)
              self.t = now
              if cost <= self.level:
                  self.level -= cost
                  return True
              return False
      bucket = TokenBucket(rate=1000, capacity=4000)  # tokens per second
      decisions = [bucket.allow(t, cost) for t, cost in
                   [(0.0, 3000), (0.1, 3000), (2.0, 2500), (2.0, 500), (2.01, 2000)]]
      print(decisions)
      assert decisions == [True, False, True, True, False]
      """),
    d("mig", "gpu-sharing",
      "MIG, time slicing or MPS: how do you share one GPU between models or tenants?",
      "MIG (A100, H100/H200, and Blackwell's B200/GB200/B300) cuts the GPU into up to 7 "
      "hardware-isolated instances, each with its own memory and compute slices: strong "
      "isolation and predictable latency, fixed sizes (a B200's 180 GB splits into slices of "
      "23, 45 or 90 GB; an A100-80GB's into 10, 20 or 40 GB). "
      "Time slicing lets processes take turns on the whole GPU: no memory isolation, context "
      "switches, noisy neighbours. MPS runs kernels of several processes concurrently with "
      "limited isolation. For a small model per tenant MIG fits well if the model fits a slice.",
      """
      from labkit.quant.memory import estimate_memory
      profiles = {  # MIG user guide: A100-80GB and B200 (180 GB) GPU-instance profiles
          "A100-80GB": {"1g.10gb": 10e9, "2g.20gb": 20e9, "3g.40gb": 40e9},
          "B200": {"1g.23gb": 23e9, "2g.45gb": 45e9, "3g.90gb": 90e9},
      }
      for fmt in ("fp16", "gptq"):
          need = estimate_memory("llama-2-7b", fmt, context_len=4096, batch_size=4).total_bytes
          fits = {gpu: [name for name, mem in slices.items() if need < mem * 0.9]
                  for gpu, slices in profiles.items()}
          print(f"Llama-2-7B {fmt} + KV for 4 x 4k: {need / 1e9:.1f} GB -> fits {fits}")
      assert estimate_memory("llama-2-7b", "gptq", 4096, 4).total_bytes < 0.9 * 20e9
      assert 0.9 * 20e9 < estimate_memory("llama-2-7b", "fp16", 4096, 4).total_bytes < 0.9 * 45e9
      """),
    d("canary", "releases",
      "How do you roll out a new model version safely (canary / gray release)?",
      "Deploy it beside the old one and route a small, sticky share of traffic (hash of user or "
      "tenant id, so a user sees one version) to it; compare error rate, latency percentiles and "
      "quality signals against the baseline; widen the share in steps (1%, 5%, 25%, 100%) and "
      "roll back by routing alone. Shadow traffic (mirrored, responses discarded) tests load "
      "without user impact. Weights load on new replicas before they take traffic.",
      """
      import hashlib
      def version(user_id, canary_percent):
          bucket = int.from_bytes(hashlib.sha256(user_id.encode()).digest()[:8], "big") % 100
          return "v2" if bucket < canary_percent else "v1"
      users = [f"user-{i}" for i in range(10000)]
      share = sum(version(u, 5) == "v2" for u in users) / len(users)
      sticky = all(version(u, 5) == version(u, 5) for u in users[:100])
      widened = all(version(u, 25) == "v2" for u in users if version(u, 5) == "v2")
      print(f"canary share {share:.1%}, sticky {sticky}, canary users stay on v2 when widened "
            f"{widened}")
      assert 0.04 < share < 0.06 and sticky and widened
      """),
    d("gateway", "gateways",
      "What does a model gateway do, and how should it route requests to replicas?",
      "One OpenAI-compatible endpoint in front of many engines: authentication, per-tenant "
      "quotas and rate limits, routing by model and version, retries and fallbacks, streaming "
      "pass-through, usage metering and logging. Route to the replica with the shortest queue "
      "or lowest KV usage; for prefix caching, route requests sharing a prefix (same system "
      "prompt) to the same replica with consistent hashing, or hit rates collapse.",
      """
      import random
      from labkit.kv.prefix import hash_prompt_blocks
      replicas, n_prompts = 4, 100
      systems = [[1000 + 100 * s + i for i in range(32)] for s in range(n_prompts)]
      rng = random.Random(0)
      reqs = [systems[rng.randrange(n_prompts)] + [rng.randrange(500) for _ in range(8)]
              for _ in range(600)]
      def simulate(route):
          seen, hits = [set() for _ in range(replicas)], 0
          for i, r in enumerate(reqs):
              key = hash_prompt_blocks(r, 16)[0]
              k = route(i, key)
              hits += key in seen[k]
              seen[k].add(key)
          return hits / len(reqs), sum(len(s) for s in seen)
      aware = simulate(lambda i, key: int.from_bytes(key[:4], "big") % replicas)
      rr = simulate(lambda i, key: i % replicas)
      print(f"prefix-aware: hit rate {aware[0]:.0%}, {aware[1]} cached prefix copies; "
            f"round-robin: {rr[0]:.0%}, {rr[1]} copies")
      assert aware[0] > rr[0] + 0.2 and aware[1] < rr[1]
      """),
    d("autoscale", "autoscaling",
      "How many replicas does a load need, and what should trigger scaling?",
      "Size from measured per-replica throughput at the latency SLO: replicas = demand tokens/s "
      "/ (replica tokens/s at the SLO) plus headroom. Scale on the demand itself: the arrival "
      "rate (requests or tokens per second, the router's own count) against that per-replica "
      "figure, and ahead of it with a forecast of the daily curve, because a new replica serves "
      "only after a cold start (pulling and loading GBs of weights): a rule that reacts even to "
      "arrivals is a cold start late on every ramp, so keep warm spares for what the forecast "
      "misses. Queue length and TTFT do not lead latency, they are latency: both stay near zero "
      "while a replica has free batch slots and climb once it is full, so they move after the "
      "arrivals do and together with the SLO breach. In labkit's fleet simulator (one replica "
      "with 16 batch slots, the load stepping from a third of its capacity to well above it) the "
      "arrival rate crossed capacity before any request missed a 0.25 s TTFT SLO, the queue "
      "reached 4 requests only around the first miss, and TTFT as measured showed the miss "
      "later still, when that request's first token came. KV usage and in-flight requests rise "
      "with the load sooner (in flight = rate x latency) but are capped by the batch limit and "
      "the KV pool. Keep queue length and TTFT as the backstop and the alert (they also catch "
      "what arrival counts miss: longer prompts, a slow replica), and never scale on GPU "
      "utilization, which reads near 100% whether the batch is 2 or 200.",
      """
      import math
      from dataclasses import replace
      from labkit.quant.memory import estimate_memory
      from labkit.router.policies import LeastOutstanding
      from labkit.sim.cost import step_time
      from labkit.sim.fleet import Fleet, FleetConfig
      from labkit.sim.traces import poisson_trace
      batch = 64
      t = step_time("llama-2-7b", "a100-80gb", 0, batch, batch * 1024)
      per_replica = batch / t  # decode tokens/s at this batch
      demand = 50 * 300  # 50 requests/s x 300 output tokens
      replicas = math.ceil(demand / (0.7 * per_replica))  # 30% headroom
      load_s = estimate_memory("llama-2-7b", "fp16").weight_bytes / 2e9  # 2 GB/s disk
      print(f"{per_replica:.0f} tokens/s per replica -> {replicas} replicas; "
            f"cold start >= {load_s:.0f} s of weight loading")
      assert replicas >= 2 and load_s > 5

      # Which signal moves first? One simulated replica (16 batch slots); evenly spaced arrivals
      # step from 4 to 20 requests/s at t = 6 s.
      step, end, slo = 6.0, 10.0, 0.25
      times = [i / 4 for i in range(int(step * 4))] + [step + i / 20 for i in range(80)]
      mix = poisson_trace(rate=20, duration=12, num_tenants=8, seed=0).specs  # lengths only
      specs = [replace(s, arrival_time=a) for s, a in zip(mix, times)]
      reqs = Fleet(LeastOutstanding(), 1, FleetConfig(token_scale=16, max_num_seqs=16)).run(
          specs, end).requests
      capacity = sum(step + 2 <= r["arrival"] + r["e2e"] < end for r in reqs) / 2  # saturated
      ticks = [k / 4 for k in range(4 * int(end) + 1)]
      rate = {t: sum(t - 1 < r["arrival"] <= t for r in reqs) for t in ticks}  # last second
      queue = {t: sum(r["arrival"] <= t < r["arrival"] + r["ttft"] for r in reqs) for t in ticks}
      late = [r for r in reqs if r["ttft"] > slo]
      t_rate = min(t for t in ticks if rate[t] >= capacity)
      t_queue = min(t for t in ticks if queue[t] >= 4)
      t_miss = min(r["arrival"] for r in late)  # the first request over the SLO arrives
      t_seen = min(r["arrival"] + r["ttft"] for r in late)  # ... and its TTFT is measured
      print(f"capacity {capacity:.1f} requests/s; queue at a third of it <= "
            f"{max(queue[t] for t in ticks if 2 <= t < step)}")
      print(f"after the step at {step:.0f} s: arrivals >= capacity at {t_rate:.2f} s, first "
            f"request over the {slo} s TTFT SLO arrives at {t_miss:.2f} s, queue >= 4 at "
            f"{t_queue:.2f} s, TTFT shows the miss at {t_seen:.2f} s")
      assert t_rate < t_miss and abs(t_queue - t_miss) <= 0.5 and t_queue < t_seen
      """),
    d("failover", "failover",
      "A replica dies in the middle of streaming a response. What should the system do?",
      "Health checks and the gateway detect it (failed connection, timeout) and stop routing "
      "there; circuit breakers keep it out until it recovers. The in-flight request is retried "
      "on another replica: re-prefill prompt plus the tokens already sent and continue decoding, "
      "so the client sees no duplicate text. Only safe because generation is deterministic given "
      "the tokens so far (or the retry resumes sampling from there). Its KV on the dead replica "
      "is simply lost.",
      """
      from labkit.sim.cost import step_time
      prompt, sent = 1500, 400
      resume = step_time("llama-2-7b", "a100-80gb", prompt + sent, 0, 0)
      redo = step_time("llama-2-7b", "a100-80gb", prompt, 0, 0) + sent * step_time(
          "llama-2-7b", "a100-80gb", 0, 1, prompt + sent // 2)
      print(f"resume by re-prefill: {resume * 1e3:.0f} ms; regenerate from scratch: "
            f"{redo * 1e3:.0f} ms")
      assert resume < redo
      """),
    d("monitoring", "monitoring",
      "What do you monitor on an LLM serving fleet?",
      "Latency: TTFT, TPOT/ITL and E2E at P50/P99; throughput in tokens/s and requests/s; queue "
      "length and queue time; KV cache usage, prefix hit rate, preemptions; GPU memory, "
      "utilization and errors (Xid); error and timeout rates per model and tenant; output "
      "quality signals (refusals, length, user feedback). Alert on SLO burn, not on single "
      "spikes; engines expose these on a /metrics endpoint for Prometheus.",
      """
      import random
      from labkit.engine.metrics import compute_metrics
      rng = random.Random(0)
      timings = []
      for i in range(200):
          arrival = i * 0.05
          queue = rng.expovariate(1 / 0.05) if i % 50 else 2.0  # a few requests stuck
          first = arrival + queue + 0.1
          toks = [first + 0.02 * k for k in range(50)]
          timings.append({"arrival_time": arrival, "first_scheduled_time": arrival + queue,
                          "first_token_time": first, "token_times": toks,
                          "finish_time": toks[-1]})
      m = compute_metrics(timings)
      print(f"TTFT p50 {m['ttft']['p50']:.2f}s, p99 {m['ttft']['p99']:.2f}s; "
            f"queue p99 {m['queue']['p99']:.2f}s; {m['tokens_per_s']:.0f} tokens/s")
      assert m["ttft"]["p99"] > 5 * m["ttft"]["p50"]  # the tail a mean would hide
      """),
    d("tail-latency", "monitoring",
      "Why is P99 latency so much worse than the mean, and what reduces it?",
      "Output lengths are long-tailed, requests queue behind long prefills, preemptions re-run "
      "work, and one slow replica catches a share of every user's traffic. Chunked prefill, "
      "decode-first scheduling, admission control (watermarks), per-request max_tokens, "
      "length-aware routing and hedged retries all cut the tail.",
      """
      import statistics
      from labkit.sim.workloads import get_workload
      outs = sorted(r.output_len for r in get_workload("chat").sample(2000, seed=0))
      mean, p99 = statistics.mean(outs), outs[int(0.99 * (len(outs) - 1))]
      print(f"output tokens: mean {mean:.0f}, P99 {p99} ({p99 / mean:.1f}x the mean)")
      assert p99 > 2.5 * mean
      """),
    d("tenants", "multi-tenancy",
      "How do you isolate tenants that share one inference fleet?",
      "Per-tenant authentication, quotas and rate limits at the gateway; priorities or weighted "
      "fair queueing in the scheduler so one tenant's burst cannot starve others; separate "
      "replicas or MIG slices for strict isolation; and no shared prefix cache across tenants: a "
      "cache hit is measurably faster, so a tenant could probe for another tenant's prompts. A "
      "per-tenant cache salt in every block key keeps their caches apart.",
      """
      from labkit.kv.prefix import hash_prompt_blocks
      prompt = list(range(64))
      a = hash_prompt_blocks(prompt, 16, cache_salt="tenant-a")
      a2 = hash_prompt_blocks(prompt, 16, cache_salt="tenant-a")
      b = hash_prompt_blocks(prompt, 16, cache_salt="tenant-b")
      print(f"same tenant shares {sum(x == y for x, y in zip(a, a2))}/4 blocks, other tenant "
            f"{sum(x == y for x, y in zip(a, b))}/4")
      assert a == a2 and not set(a) & set(b)
      """),
    d("overlap-scheduling", "tensorrt-llm",
      "Overlap scheduling (SGLang's zero-overhead scheduler, vLLM's async scheduling, "
      "TensorRT-LLM's overlap scheduler) prepares step N+1 while step N computes. What does it "
      "hide, what does it cost, and why does it hardly pay when the forward runs on the CPU "
      "that schedules?",
      "Between two forwards the host schedules, allocates blocks, matches prefixes, builds the "
      "input tensors, checks stop conditions and detokenises; with a small model or a fast GPU "
      "that is a large share of each step, and the accelerator idles through it. Overlap runs "
      "that work for N+1 (and the output processing of N-1) while N computes: the scheduler "
      "assumes every running sequence gets one token in N, and N+1's inputs take N's sampled "
      "tokens by reference (SGLang's future tokens) once they exist. The price is one step of "
      "lookahead: a request that finishes in N already holds a slot in N+1 that is thrown "
      "away, outputs come out a step later, and a step that may preempt, a grammar that needs "
      "N's token, or speculative steps need special handling. On a GPU the forward's kernels "
      "run asynchronously and the host is free. On a CPU the forward runs on the same machine "
      "and, in Python, under the GIL, so the host thread only overlaps what the forward does "
      "without it. labkit measured each cost: a compiled graph with inductor's Python wrapper "
      "holds the GIL between kernels, and scheduling started before the forward reached its "
      "graph took turns with the forward's own Python; the full graphs' C++ wrapper (one "
      "GIL-free call) and starting the host thread at the graph's launch remove both. Handing "
      "the forward itself to a worker put two thread wake-ups on every step (about 0.05-0.07 "
      "ms each from an idle vCPU), more than the 0.03 ms of scheduling there is to hide at "
      "batch 1, so the forward stays on the calling thread. What is left is sharing the "
      "machine: the graph runs about 5% slower while the host thread works on the other core. "
      "Every cure with overlap is 0.93x fused + compiled at batch 1 and 1.00x at batch 32 "
      "(labkit bench step).",
      """
      from labkit.bench.step_gemv import thread_round_trip_us
      # per decode step at batch 1, from labkit bench step's committed run (ms)
      hidden = 0.020 + 0.007  # schedule + detokenise: what the main thread can run meanwhile
      trip = thread_round_trip_us() / 1e3  # submit + wake + result, measured here, now
      print(f"one hand-off to a worker and back: {trip * 1e3:.0f} us; overlap hides at most "
            f"{hidden * 1e3:.0f} us of a batch-1 step")
      print("pays here" if hidden > trip else "costs more than it hides here")
      assert trip > 0
      """),
]

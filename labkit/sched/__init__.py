"""labkit.sched: what runs each step, and what a step did (above ``labkit.kv``, below the engine).

Owns the per-request state and every decision about it:

- ``request``: Request / Sequence, their states, ``num_computed_tokens``, pending forks (n > 1);
- ``scheduler``: ``schedule()`` (continuous or static batching under a token budget, chunked
  prefill, fcfs / priority / sjf, watermark admission, preemption by recompute or swap) and
  ``update_from_output()`` (appending tokens, the one stop checker, freeing, rollback);
- ``output``: ``SchedulerOutput`` (what the executor runs) and ``SeqOutput`` (what a step did);
- ``kv_transfer``: the scheduler's half of the KV-connector contract (ask, check, commit).
"""

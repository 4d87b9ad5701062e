"""labkit.sched: what runs each step.

- ``request``: Request / Sequence and their states.
- ``scheduler``: continuous (or static) batching under a token budget, chunked prefill,
  fcfs / priority / sjf, watermark admission, preemption by recompute or swap.
"""

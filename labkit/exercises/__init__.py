"""Interview-prep exercises with automatic checks, and drills.

Each exercise states its contract in the notebook's stub docstring and has a ``check(...)`` that
runs the learner's function against labkit's own implementation (``kv/prefix.py``, ``spec/``,
``quant/``, ``engine/metrics.py``, the engine itself) or, where labkit has none with that exact
contract, the checker's plainly written reference; it prints the input, the expected and actual
values and a hint when something is wrong:

- ``kv_size``          KV-cache bytes with grouped-query attention
- ``allocator``        block allocator with ref counts, fork, copy-on-write (random op sequences);
                       ``allocator_engine.check_on_model`` then drives the real model with it
- ``prefix_cache``     chained prefix-block hashes and the longest cached prefix
- ``scheduler_step``   one continuous-batching step (also replayed against real engine runs)
- ``latency``          TTFT / TPOT / P99 (also on a real engine run)
- ``quantization``     INT8 per-channel, INT4 group-wise, NF4
- ``speculative``      acceptance rule (chi-square, seeded) and the expected speed-up
- ``triton_kernels``   vector add and paged-attention decode through the CPU interpreter
- ``tp_attention``     tensor-parallel split of one attention block (vs ``labkit.parallel``'s plan);
                       ``tp_forward`` its all-reduce, on thread ranks then 2 gloo processes
- ``prefix_affinity``  the router's consistent hashing with bounded loads (measured properties,
                       then the fleet simulator's hit rate against round-robin)

Underneath: ``checks`` (reports, strict mode, ``ready`` for gated cells), ``shared`` (``Seq``, the
tiny engine), ``progress`` (the local progress file and widget), ``quiz`` (the main notebooks'
questions), ``drills`` (``labkit drill``). ``solutions`` holds the reference answers and is read
only by ``inject``, under ``LABKIT_INJECT_SOLUTIONS=1``; the negative controls (plausible wrong
answers every checker must reject) live in tests/exercises.
"""

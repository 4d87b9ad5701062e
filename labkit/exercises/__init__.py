"""Interview-prep exercises with automatic checks, and drills.

Each exercise module poses a contract (``CONTRACT``) and a ``check(...)`` that runs the learner's
function against labkit's own implementation and property tests, printing the input, expected and
actual values and a hint when something is wrong:

- ``kv_size``          KV-cache bytes with grouped-query attention
- ``allocator``        block allocator with ref counts, fork, copy-on-write (random op sequences);
                       ``allocator_engine.check_on_model`` then drives the real model with it
- ``prefix_cache``     chained prefix-block hashes and the longest cached prefix
- ``scheduler_step``   one continuous-batching step (also replayed against real engine runs)
- ``latency``          TTFT / TPOT / P99 (also on a real engine run)
- ``quantization``     INT8 per-channel, INT4 group-wise, NF4
- ``speculative``      acceptance rule (chi-square, seeded) and the expected speed-up
- ``triton_kernels``   vector add and paged-attention decode through the CPU interpreter

``solutions`` holds reference solutions (notebooks never import it unless
``LABKIT_INJECT_SOLUTIONS=1``), ``wrong``/``triton_wrong`` the negative controls, ``drills`` the
``labkit drill`` command, ``progress`` the local progress file and widget.
"""

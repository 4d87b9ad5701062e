"""labkit.sim: the engine on a roofline clock -- no tensors, the real scheduler.

Owns the GPU / model presets (``presets``), the cost model (``cost``: prefill compute-bound,
decode memory-bound, swaps over the host link), workloads (``workloads``), the ``SimExecutor``
that implements the engine's executor contract on that cost model (``executor``), and
``simulate()`` (``simulate``), which runs a workload through an ``LLMEngine`` around it.
"""

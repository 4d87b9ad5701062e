"""labkit.engine: the serving engine in vLLM's vocabulary (above ``labkit.sched``).

Owns the API and the step loop, not the decisions (``labkit.sched``) or the memory
(``labkit.kv``); it never imports ``labkit.spec`` or ``labkit.sim`` (they plug in).

- ``llm.LLM`` / ``llm_engine.LLMEngine`` / ``sampling_params.SamplingParams`` /
  ``outputs.RequestOutput``: the API; ``LLMEngine.step()`` is schedule -> execute ->
  update_from_output -> outputs, plus detokenization.
- ``executor``: the executor contract (``Executor``, ``ModelRunnerOutput``) and the factory
  registry; ``model_runner``: ``ModelRunner`` (packed forward, sampling) and ``ModelExecutor``.
- ``validate``: request checks at ``add_request``; the settings live in ``labkit.config``.
- ``trace``: one record per step (``TraceObserver``), ``replay`` to the KV state at any step.
- ``metrics``: TTFT / TPOT / ITL / E2E from ``engine.request_timings()``; ``invariants``: KV
  accounting checks; ``clock``: wall and virtual time.
"""

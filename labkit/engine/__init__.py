"""labkit.engine: the serving engine, in vLLM's vocabulary.

- ``llm.LLM`` / ``llm_engine.LLMEngine`` / ``sampling_params.SamplingParams`` /
  ``outputs.RequestOutput``: the API.
- ``model_runner.ModelExecutor``: one packed forward per step on the real model.
- ``sim_executor.SimExecutor`` + ``simulate.simulate``: the same engine on a roofline clock.
- ``trace.Trace`` / ``trace.replay``: one record per step; the KV state at any step.
- ``metrics``: TTFT / TPOT / ITL / E2E from ``engine.request_timings()``.
The block pool lives in ``labkit.kv``, the scheduler in ``labkit.sched``.
"""

"""labkit.serve: the OpenAI-compatible service around the engine (``labkit serve MODEL``).

- ``async_llm.AsyncLLM``: the async front: per-request output streams; cancel = abort before
  the next step. ``engine_core``: the engine loop it drives (vLLM's EngineCore), in a thread of
  the server or in its own process (``EngineSpec``, ``labkit serve``'s default: no GIL
  shared with the HTTP loop).
- ``protocol``: OpenAI request parsing (every client mistake a 4xx ``APIError``); ``replies``:
  response and SSE chunk shapes. ``chat``: chat templates (the model's Jinja template, else
  ChatML).
- ``serving``: one accepted request from engine streams to SSE / JSON; timeouts; disconnects.
- ``api_server``: the FastAPI app (routes, keys, drain state); ``admission``: the gates a
  request passes before the engine sees it (fields, context, queue, rate limits).
- ``limits``: API keys (constant-time) and token buckets. ``metrics``: Prometheus (``labkit:``).
- ``launcher``: the ``labkit serve`` command, graceful drain on SIGTERM, ``ServerThread``;
  ``process.ServerProcess``: the server as a child process (benchmarks, notebooks).
"""

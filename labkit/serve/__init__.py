"""The service around the engine: an OpenAI-compatible HTTP server over ``LLMEngine``.

Owns the async front (the engine loop off the event loop), the OpenAI protocol models, the
API routes, admission control, rate limits and the Prometheus metrics.
"""

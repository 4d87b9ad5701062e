"""Compatibility: incremental detokenization lives in :mod:`labkit.engine.llm_engine`
(``update_text``, on the request path) and stop strings in the scheduler's stop checker
(:mod:`labkit.sched.scheduler`)."""

from labkit.engine.llm_engine import update_text
from labkit.sched.stop import stop_string_hit

__all__ = ["stop_string_hit", "update_text"]

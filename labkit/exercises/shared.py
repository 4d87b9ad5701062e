"""What several exercises share: the scheduler's view of a sequence and the tiny real engine.

``Seq`` is the input of the scheduler exercise and of its model-driving check. ``tiny_engine``
is labkit's ``LLMEngine`` on the seeded tiny model (``labkit.model.testing``), which the prefix,
scheduler and latency checkers run to compare the learner's answer with what the engine did.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from labkit.engine.llm_engine import LLMEngine
from labkit.model.testing import tiny_model

__all__ = ["Seq", "tiny_engine", "tiny_model"]


@dataclass
class Seq:
    """What the scheduler sees of a sequence. Decoding once num_computed >= num_prompt."""

    seq_id: str
    num_prompt_tokens: int
    num_computed_tokens: int = 0  # tokens whose KV is already cached (prefix hit or earlier chunks)


def tiny_engine(**engine_kwargs: Any) -> LLMEngine:
    """``LLMEngine`` on the tiny model, no tokenizer (requests are token ids), block size 4."""
    return LLMEngine.from_model(tiny_model(), None, **{"block_size": 4, **engine_kwargs})

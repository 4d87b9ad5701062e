"""What the engine hands back: RequestOutput / CompletionOutput (vLLM's shape) and StepOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)


@dataclass
class StepOutput:
    """One sequence's news from one ``engine.step()``: the tokens it gained (a speculative step
    can add several) and the text they decode to."""

    request_id: str
    seq_id: str
    index: int
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    finish_reason: str | None

"""What the engine hands back: RequestOutput / CompletionOutput (vLLM's shape) and StepOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability (vLLM's ``Logprob``): ``rank`` is its place in the
    vocabulary sorted by logprob (1 = most likely); ``decoded_token`` its text alone."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


#: per generated token: {token_id: Logprob}, the sampled token first, then the top-k
SampleLogprobs = list[dict[int, Logprob]]
#: per prompt token, the same given its prefix; the first prompt token has none (None)
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    logprobs: SampleLogprobs | None = None  # SamplingParams(logprobs=k) only

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
    prompt_logprobs: PromptLogprobs | None = None  # SamplingParams(prompt_logprobs=k) only


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
    logprobs: SampleLogprobs | None = None  # of new_token_ids, when the request asked
    #: on a sequence's first output, when the request asked: the whole prompt's
    prompt_logprobs: PromptLogprobs | None = None

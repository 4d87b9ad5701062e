"""SamplingParams, named and defaulted as vLLM's so code and intuition transfer."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 = greedy; top_k 0 or -1 = off; top_p 1.0 = off. ``seed`` makes sampling
    reproducible: sample i of n uses ``torch.Generator().manual_seed(seed + i)``, exactly as
    ``labkit.model.generate.generate(..., seed=seed + i)`` would. ``stop`` strings end a sample
    (the stop string is cut from the text); ``stop_token_ids`` and EOS end it too (the stopping
    token is kept in ``token_ids``, like vLLM). ``detokenize=False`` skips text (benchmarks).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop: str | list[str] | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None
    ignore_eos: bool = False
    detokenize: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.validate()

    def validate(self) -> None:
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (off) or a positive int, got {self.top_k!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int or None, got {self.seed!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if self.stop and not self.detokenize:
            raise ValueError("stop strings are matched on text: they need detokenize=True")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

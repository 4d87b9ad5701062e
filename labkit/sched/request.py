"""Request and Sequence: the scheduler's units of work and their state machine.

A Request is what a user submitted: one prompt, sampling parameters, a priority, timestamps.
It owns ``n`` Sequences (samples). Sample 0 is created at admission and prefills the prompt; the
other n-1 are *forked* from it when its prefill finishes, sharing the prompt's KV blocks until
they diverge (copy-on-write). From then on each sequence is scheduled, preempted and finished on
its own, which is what lets preemption by recompute work for n > 1 too.

Sequence states: WAITING -> RUNNING -> (WAITING after recompute preemption | SWAPPED after swap
preemption) -> ... -> FINISHED (stop | length | abort).

A sequence's progress is ``num_computed_tokens``: how many of ``token_ids`` have KV in the cache.
Each step computes the next chunk of the rest; when a chunk reaches the end a new token is sampled
(so a decoding sequence always has exactly one uncomputed token, the last one sampled).
"""

from __future__ import annotations

import enum
from typing import Any

import torch


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class Sequence:
    def __init__(self, request: Request, index: int, token_ids: list[int]) -> None:
        self.request = request
        self.request_id = request.request_id
        self.index = index
        self.seq_id = request.request_id if request.n == 1 else f"{request.request_id}:{index}"
        self.token_ids = token_ids
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.cpu_block_table: list[int] = []
        self.block_hashes: list[bytes] = []
        self.cache_salt = request.cache_salt
        self.lora_int_id = request.lora_int_id  # a prefix-cache key part (kv/prefix.py)
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self._generator: torch.Generator | None = None
        self.token_times: list[float] = []
        self.num_cached_tokens = 0  # prefix-cache hit tokens at first admission
        self.output_text = ""
        self.streamed_text = ""  # the part of output_text streams have been sent (detokenizer)
        # one {token_id: Logprob} per output token, when the request asked (params.logprobs)
        self.logprobs: list | None = None if getattr(request.params, "logprobs", None) is None \
            else []
        self.sort_key: tuple = ()
        # masks this sample's logits row before sampling and is advanced with each appended
        # token (``__call__(row) -> row``, ``accept(token_ids)``); opaque to the scheduler
        f = getattr(request, "logits_processor_factory", None)
        self.logits_processor: Any = f() if f is not None else None

    @property
    def generator(self) -> torch.Generator | None:
        """This sample's random stream (None when greedy), made on first use: seeded samples get
        ``seed + index`` so sample i of a request is reproducible on its own; an executor that
        never samples (the simulator) never pays for one."""
        p = self.request.params
        if self._generator is None and getattr(p, "temperature", 0) != 0:
            self._generator = torch.Generator()
            if getattr(p, "seed", None) is not None:
                self._generator.manual_seed(p.seed + self.index)
            else:
                self._generator.seed()
        return self._generator

    @property
    def skip_reading_prefix_cache(self) -> bool:
        """vLLM's rule: prompt logprobs need logits at every prompt position, and a cached
        prefix has none, so such a request computes its whole prompt (it still writes the
        cache for others)."""
        return self.request.prompt_logprobs is not None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def is_prefill(self) -> bool:
        """Still computing prompt (or, after recompute preemption, prompt + outputs) KV."""
        return (self.num_computed_tokens < self.num_prompt_tokens
                or self.num_computed_tokens < len(self.token_ids) - 1)

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id!r}, {self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={self.block_table})")


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: Any,
                 arrival_time: float, priority: int = 0, cache_salt: str | None = None,
                 index: int = 0, logits_processor_factory: Any = None,
                 lora_request: Any = None) -> None:
        self.request_id = request_id
        # the LoRA adapter this request runs with (labkit.lora.LoRARequest; None = the base
        # model): data the scheduler's admission policy, the prefix cache and the LoRA
        # executor read, as ``cache_salt`` is; the scheduler itself never looks inside it
        self.lora_request = lora_request
        # a zero-argument callable making each sample's logits processor (structured outputs):
        # set before the first Sequence exists, so sample 0 and every fork get their own
        self.logits_processor_factory = logits_processor_factory
        self.prompt_token_ids = list(prompt_token_ids)
        self.params = params
        self.n = getattr(params, "n", 1)
        self.arrival_time = arrival_time
        self.priority = priority
        self.cache_salt = cache_salt
        self.index = index  # add order: the final tie-break of every policy
        self.seqs: list[Sequence] = [Sequence(self, 0, list(prompt_token_ids))]
        self.num_pending_forks = self.n - 1  # samples 1..n-1, forked when sample 0's prefill ends
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.static_batch = False  # static batching: taken into the current batch
        # prompt logprobs scored so far (params.prompt_logprobs); the first token has no prefix
        self.prompt_logprobs: list | None = None \
            if getattr(params, "prompt_logprobs", None) is None else [None]

    @property
    def lora_int_id(self) -> int | None:
        """The adapter's id (vLLM's ``lora_int_id``), None for the base model."""
        return None if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.num_pending_forks == 0 and all(s.is_finished for s in self.seqs)

    def fork_children(self) -> list[Sequence]:
        """Create samples 1..n-1 as copies of sample 0 (the caller shares blocks)."""
        parent = self.seqs[0]
        children = []
        for i in range(1, self.n):
            c = Sequence(self, i, list(parent.token_ids[: parent.num_prompt_tokens]))
            c.num_computed_tokens = parent.num_computed_tokens
            c.status = SequenceStatus.RUNNING
            c.sort_key = parent.sort_key[:-1] + (i,)
            children.append(c)
        self.seqs.extend(children)
        self.num_pending_forks = 0
        return children

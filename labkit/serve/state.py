"""What the server's routes share: its configuration (:class:`ServeConfig`, from ``labkit
serve``'s flags) and its state (:class:`ServerState`, on ``app.state.serve``).

They live apart from :mod:`labkit.serve.api_server` so that the modules the routes call
(:mod:`labkit.serve.admission` and the rest) can name the state they are handed without
importing the server that hands it to them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from labkit.serve.async_llm import AsyncLLM
from labkit.serve.body import peer as _peer
from labkit.serve.cancel import LiveCalls
from labkit.serve.chat import chatml
from labkit.serve.limits import Authenticator
from labkit.serve.lora_routes import LoRARegistry
from labkit.serve.metrics import ServerMetrics
from labkit.serve.model_card import seeder

log = logging.getLogger("uvicorn.error")  # the server's log: uvicorn's handler and --log-level


@dataclass
class ServeConfig:
    model_name: str = "labkit-tiny"
    max_waiting: int | None = None
    queue_timeout: float | None = None
    request_timeout: float | None = None
    api_keys: dict[str, str] = field(default_factory=dict)
    rate_limit_rps: float | None = None
    rate_limit_tps: float | None = None
    max_body_bytes: int = 1 << 20
    max_n: int = 16
    drain_timeout: float = 30.0
    # headers and body must be in within this many seconds of the request's first byte (None:
    # no bound); enforced by the HTTP protocol (labkit.serve.launcher.uvicorn_config)
    request_read_timeout: float | None = 30.0
    bucket: Any = None  # the token-bucket class (None: labkit.serve.limits.TokenBucket)
    # freeze the startup heap once the engine core runs (labkit.utils.freeze_gc_heap): on in
    # `labkit serve`, whose process is the server's alone; off for a server started inside a
    # notebook or a test, whose heap is not the server's to freeze
    freeze_gc: bool = False
    seed: int | None = None  # --seed (labkit.serve.model_card.assign_seed)
    features: dict[str, Any] = field(default_factory=dict)  # shown in /v1/models
    lora_modules: dict[str, str] = field(default_factory=dict)  # --lora-modules (lora_routes)
    stream_interval: int = 1  # --stream-interval: tokens per SSE event (serve.stream_interval)


class ServerState:
    """Everything the routes share; ``app.state.serve`` holds it."""

    def __init__(self, llm: AsyncLLM, tokenizer: Any, config: ServeConfig,
                 chat_template: Any = None) -> None:
        self.llm, self.tokenizer, self.config = llm, tokenizer, config
        self.render_chat = chat_template or chatml
        self.seeds = seeder(config.seed)
        self.metrics = ServerMetrics(llm, config.model_name)
        llm.on_step = self.metrics.on_step
        self.loras = LoRARegistry(llm, config.model_name, config.lora_modules)
        self.metrics.registry.register(self.loras)
        self.auth = Authenticator(config.api_keys, config.rate_limit_rps,
                                  config.rate_limit_tps, bucket=config.bucket)
        self.draining = False
        self.live = LiveCalls()  # running calls by the id their client sees
        # accepted = finished + aborted + timed_out; the rest never were accepted
        self.counts = {"accepted": 0, "finished": 0, "aborted": 0, "timed_out": 0,
                       "rejected": 0, "client_gone": 0, "read_timeout": 0}
        self._next_id = 0
        self.max_model_len: int = llm.max_model_len  # the engine process's handshake, or
        self.vocab_size: int | None = llm.vocab_size  # the engine itself (thread mode)

    def new_request_id(self) -> str:
        self._next_id += 1
        return f"srv-{self._next_id}"

    def num_queued(self, extra_seqs: int = 0) -> int:
        """Sequences that would wait for a running slot with ``extra_seqs`` more: those held
        beyond the batch's ``max_num_seqs`` (module docstring). An engine that does not say
        its batch size falls back to the engine's waiting count of the last step."""
        cap = self.llm.max_num_seqs
        if cap is None:
            s = self.llm.stats
            return (s.get("num_waiting", 0) + s.get("num_pending", 0) +
                    self.llm.num_pending_adds + extra_seqs)
        return max(0, self.llm.num_seqs_in_flight + extra_seqs - cap)

    def on_read_timeout(self, client: Any, what: str = "request") -> None:
        """A request not in whole within the read timeout was answered 408 and closed."""
        self.counts["read_timeout"] += 1
        self.metrics.errors.labels(self.config.model_name, "408").inc()
        log.info("%s: %s not received within %g s (--request-read-timeout): 408, connection "
                 "closed", _peer(client), what, self.config.request_read_timeout)

"""SamplingParams, named and defaulted as vLLM's so code and intuition transfer."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from numbers import Real
from typing import Any

from labkit.errors import SamplingParamsError, StructuredOutputsError
from labkit.utils import is_int as _is_int

MAX_LOGPROBS = 20  # vLLM's default max_logprobs (and OpenAI's top_logprobs limit)
KINDS = ("json", "regex", "choice", "grammar", "json_object")  # structured-output constraints


def _is_real(x: Any) -> bool:
    return isinstance(x, Real) and not isinstance(x, bool)


def _as_list(name: str, x: Any) -> list:
    if x is None:
        return []
    if isinstance(x, (str, bytes, dict)) or not hasattr(x, "__iter__"):
        raise SamplingParamsError(f"{name} must be a list, got {x!r}")
    return list(x)


@dataclass
class StructuredOutputsParams:
    """Exactly one constraint, named as vLLM's (v0.10+): ``json`` (a JSON schema, dict or str),
    ``json_object=True`` (any JSON object), ``regex``, ``choice`` (a list of strings: the output
    is one of them) or ``grammar`` (EBNF, xgrammar's GBNF dialect). ``disable_any_whitespace``
    makes JSON compact (no free whitespace between tokens), as vLLM's option of that name."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Shape checks that need no xgrammar; the constraint itself is checked on compile."""
        given = [k for k in KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise StructuredOutputsError(f"structured_outputs takes exactly one of {KINDS}, "
                                         f"got {given or 'none'}")
        kind = given[0]
        v = getattr(self, kind)
        ok = {"json": isinstance(v, (str, dict)), "regex": isinstance(v, str) and v != "",
              "grammar": isinstance(v, str) and v.strip() != "", "json_object": v is True,
              "choice": isinstance(v, (list, tuple)) and len(v) > 0
              and all(isinstance(c, str) and c for c in v)}[kind]
        if not ok:
            want = {"json": "a JSON schema (dict or str)", "regex": "a non-empty str",
                    "grammar": "a non-empty EBNF str", "json_object": "True",
                    "choice": "a non-empty list of non-empty str"}[kind]
            raise StructuredOutputsError(f"structured_outputs.{kind} must be {want}, got {v!r}")

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    def key(self) -> tuple[str, str, bool]:
        """A hashable identity for the grammar cache (a dict schema in canonical JSON)."""
        v = getattr(self, self.kind)
        if isinstance(v, dict):
            v = json.dumps(v, sort_keys=True)
        elif isinstance(v, (list, tuple)):
            v = json.dumps(list(v))
        return self.kind, str(v), self.disable_any_whitespace


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    temperature 0 = greedy; top_k 0 or -1 = off; top_p 1.0 = off. ``seed`` makes sampling
    reproducible: sample i of n uses ``torch.Generator().manual_seed(seed + i)``, exactly as
    ``labkit.model.generate.generate(..., seed=seed + i)`` would. ``stop`` strings end a sample
    (the stop string is cut from the text); ``stop_token_ids`` and EOS end it too (the stopping
    token is kept in ``token_ids``, like vLLM). ``detokenize=False`` skips text (benchmarks).

    ``logprobs=k`` (0..MAX_LOGPROBS) returns, per generated token, the sampled token's logprob
    and the k most likely tokens' (``CompletionOutput.logprobs``). They are of the distribution
    actually sampled from: after temperature, top-k and top-p (vLLM's ``processed_logprobs``;
    filtered-out tokens are -inf); greedy requests (temperature 0) get the raw ``log_softmax``
    of the logits. ``prompt_logprobs=k`` returns each prompt token's logprob given its prefix
    (``RequestOutput.prompt_logprobs``, the first one None), from the raw logits; such a request
    skips the prefix cache lookup (a cached prefix has no logits). None (default) = not computed.

    ``structured_outputs=StructuredOutputsParams(json=schema)`` (or ``regex``, ``choice``,
    ``grammar``, ``json_object``) constrains the output with xgrammar
    (:mod:`labkit.engine.structured_output`): tokens outside the grammar are masked before
    sampling, and the sequence ends with EOS when the grammar is complete. Logprobs of such a
    request are of the masked distribution (what was sampled from).

    ``kv_transfer_params`` (vLLM's field for disaggregated serving) is read by a KV connector,
    never by the sampler: ``{"do_remote_decode": True, "remote_host": H, "remote_port": P}`` makes
    a prefill instance push the request's KV to the decode instance at ``H:P`` when it finishes
    (:mod:`labkit.kv.connector.p2p`).
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
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_outputs: StructuredOutputsParams | None = None
    kv_transfer_params: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check types and ranges; raises SamplingParamsError naming the field. Also run by
        ``add_request``, so fields changed after construction are checked before they can
        reach a step (a NaN temperature would otherwise fail inside sampling, mid-batch)."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list("stop", self.stop)
        self.stop_token_ids = _as_list("stop_token_ids", self.stop_token_ids)
        if not _is_int(self.n) or self.n < 1:
            raise SamplingParamsError(f"n must be an int >= 1, got {self.n!r}")
        if not _is_real(self.temperature) or not self.temperature >= 0 \
                or math.isinf(self.temperature):
            raise SamplingParamsError(f"temperature must be a finite number >= 0 (0 = greedy), "
                                      f"got {self.temperature!r}")
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise SamplingParamsError(f"top_p must be a number in (0, 1] (1 = off), "
                                      f"got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < -1:
            raise SamplingParamsError(
                f"top_k must be -1 or 0 (off) or a positive int, got {self.top_k!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise SamplingParamsError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.seed is not None:
            # sample i seeds torch.Generator().manual_seed(seed + i), which takes [-2^63, 2^64)
            if not _is_int(self.seed):
                raise SamplingParamsError(f"seed must be an int or None, got {self.seed!r}")
            if not -(2**63) <= self.seed <= 2**64 - self.n:
                raise SamplingParamsError(f"seed must be in [-2**63, 2**64 - n] (sample i uses "
                                          f"seed + i), got {self.seed}")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise SamplingParamsError(f"stop strings must be non-empty str, got {self.stop!r}")
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise SamplingParamsError(
                f"stop_token_ids must be a list of token ids (ints >= 0), got "
                f"{self.stop_token_ids!r}")
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(self, name)
            if k is not None and (not _is_int(k) or not 0 <= k <= MAX_LOGPROBS):
                raise SamplingParamsError(f"{name} must be None or an int in [0, {MAX_LOGPROBS}] "
                                          f"(how many top tokens to return), got {k!r}")
        self._check_structured_outputs()
        self._check_kv_transfer_params()
        if self.stop and not self.detokenize:
            raise SamplingParamsError(
                "stop strings are matched on text: they need detokenize=True")

    def _check_kv_transfer_params(self) -> None:
        """A dict with str keys; with ``do_remote_decode`` it must name where the KV goes, or
        the prefill engine would find out only when the request finishes, inside a step."""
        ktp = self.kv_transfer_params
        if ktp is None:
            return
        if not isinstance(ktp, dict) or any(not isinstance(k, str) for k in ktp):
            raise SamplingParamsError(f"kv_transfer_params must be a dict with str keys, got "
                                      f"{ktp!r}")
        if ktp.get("do_remote_decode"):
            host, port = ktp.get("remote_host"), ktp.get("remote_port")
            if not isinstance(host, str) or not host or not _is_int(port) \
                    or not 0 < port < 65536:
                raise SamplingParamsError(
                    "kv_transfer_params with do_remote_decode needs remote_host (a non-empty "
                    f"str) and remote_port (an int in 1..65535), got {ktp!r}")

    def _check_structured_outputs(self) -> None:
        so = self.structured_outputs
        if isinstance(so, dict):  # the JSON body's shape, as vLLM accepts it
            try:
                self.structured_outputs = so = StructuredOutputsParams(**so)
            except TypeError as e:
                raise StructuredOutputsError(f"structured_outputs: {e}") from e
        if so is not None and not isinstance(so, StructuredOutputsParams):
            raise StructuredOutputsError("structured_outputs must be a StructuredOutputsParams, "
                                         f"got {type(so).__name__}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

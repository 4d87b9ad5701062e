"""Input checks for LLMEngine: every bad request or setting fails here, with what to fix.

Why up front: a value that is only wrong deep inside ``step()`` (a float block size, a salt that
is not text, a token id the embedding cannot index) would fail a whole batch of other users'
requests, or hang a request in the queue forever (a prompt that can never fit the pool), or be
silently coerced into a wrong answer (``int(1.7) == 1``, ``int("7") == 7``). So types are
checked, not coerced.
"""

from __future__ import annotations

import math
from numbers import Integral, Real
from typing import Any

from labkit.engine.errors import EngineConfigError, InvalidPromptError
from labkit.kv.block_manager import cdiv


def is_int(x: Any) -> bool:
    """An integer that is not a bool (numpy integers count)."""
    return isinstance(x, Integral) and not isinstance(x, bool)


def check_int(name: str, value: Any, minimum: int = 1) -> int:
    if not is_int(value) or value < minimum:
        raise EngineConfigError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def check_max_model_len(max_model_len: int | None, max_position_embeddings: int) -> int:
    """The engine's context may be shorter than the model's, never longer: positions past
    max_position_embeddings would fail inside the model forward, mid-batch."""
    if max_model_len is None:
        return max_position_embeddings
    check_int("max_model_len", max_model_len, 2)
    if max_model_len > max_position_embeddings:
        raise EngineConfigError(f"max_model_len={max_model_len} exceeds the model's context "
                                f"(max_position_embeddings={max_position_embeddings}); "
                                "lower it or leave it unset")
    return int(max_model_len)


def prompt_ids(request_id: str, prompt: Any, prompt_token_ids: Any, tokenizer: Any) -> list[int]:
    """Text (needs a tokenizer) or a flat sequence of int token ids -> list[int]."""
    if prompt_token_ids is None:
        if isinstance(prompt, str):
            if tokenizer is None:
                raise InvalidPromptError("a text prompt needs a tokenizer; pass token ids instead")
            prompt_token_ids = tokenizer.encode(prompt)
        elif prompt is None:
            raise InvalidPromptError("give a prompt (text or token ids)")
        else:
            prompt_token_ids = prompt
    if hasattr(prompt_token_ids, "tolist"):  # torch tensor / numpy array
        prompt_token_ids = prompt_token_ids.tolist()
    if not isinstance(prompt_token_ids, (list, tuple, range)):
        raise InvalidPromptError(f"request {request_id!r}: a prompt is text or a list of token "
                                 f"ids, got {type(prompt_token_ids).__name__}")
    for t in prompt_token_ids:
        if not is_int(t):
            raise InvalidPromptError(
                f"request {request_id!r}: token ids must be ints, got {t!r} "
                f"({type(t).__name__}); give one flat list of ids per request")
    return [int(t) for t in prompt_token_ids]


def check_request_args(request_id: Any, params: Any, vocab_size: int | None,
                       cache_salt: Any, arrival_time: Any) -> None:
    if not isinstance(request_id, (str, Integral)) or isinstance(request_id, bool):
        raise InvalidPromptError(f"request_id must be a str, got {request_id!r}")
    if cache_salt is not None and not isinstance(cache_salt, str):
        raise InvalidPromptError(f"cache_salt must be a str or None, got {cache_salt!r}")
    if arrival_time is not None and (not isinstance(arrival_time, Real)
                                     or not math.isfinite(arrival_time)):
        raise InvalidPromptError(f"arrival_time must be a finite number of seconds or None, "
                                 f"got {arrival_time!r}")
    bad = [t for t in params.stop_token_ids if vocab_size is not None and t >= vocab_size]
    if bad:
        raise InvalidPromptError(f"stop_token_ids {bad} are outside the vocabulary "
                                 f"[0, {vocab_size}): they could never match")


def check_fits(engine: Any, rid: str, ids: list[int], params: Any, priority: Any) -> None:
    """The request can be served to the end by this engine: in vocabulary, inside the context,
    and within the pool and token budget even at its longest -- otherwise it would wait in the
    queue forever (or be preempted forever), which is worse than an error now."""
    cfg = engine.config
    if not ids:
        raise InvalidPromptError(f"request {rid!r}: the prompt is empty")
    if engine.vocab_size is not None and (min(ids) < 0 or max(ids) >= engine.vocab_size):
        raise InvalidPromptError(f"request {rid!r}: token ids must be in [0, "
                                 f"{engine.vocab_size})")
    if len(ids) >= engine.max_model_len:
        raise InvalidPromptError(f"request {rid!r}: prompt of {len(ids)} tokens leaves no "
                                 f"room in the model's context of {engine.max_model_len} "
                                 "tokens; shorten it")
    if params.n > cfg.max_num_seqs:
        raise InvalidPromptError(f"n={params.n} exceeds max_num_seqs={cfg.max_num_seqs}; "
                                 "lower n or raise max_num_seqs")
    if params.stop and engine.tokenizer is None:
        raise InvalidPromptError("stop strings need a tokenizer; use stop_token_ids instead")
    if cfg.policy == "priority" and not is_int(priority):
        raise InvalidPromptError(f"priority must be an int, got {priority!r}")
    total = min(len(ids) + params.max_tokens, engine.max_model_len)
    need = cdiv(total + cfg.num_lookahead_slots, engine.block_size)
    if need > engine.block_manager.num_blocks:
        raise InvalidPromptError(
            f"request {rid!r} needs up to {need} KV blocks ({total} tokens) but the pool "
            f"has only {engine.block_manager.num_blocks}: it could never finish; raise "
            "num_blocks / kv_cache_bytes or lower max_tokens")
    if not cfg.enable_chunked_prefill and total > cfg.max_num_batched_tokens:
        raise InvalidPromptError(
            f"request {rid!r}: {total} tokens may need one prefill step but "
            f"max_num_batched_tokens={cfg.max_num_batched_tokens}; enable chunked prefill "
            "or raise the budget")

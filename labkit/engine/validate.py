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

from labkit.config import EngineConfig
from labkit.errors import InvalidPromptError
from labkit.kv.hybrid import max_blocks_held
from labkit.utils import cdiv, check_int, is_int

__all__ = ["check_fits", "check_int", "check_request_args", "is_int", "prompt_ids"]


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


def check_fits(config: EngineConfig, rid: str, ids: list[int], params: Any, priority: Any,
               has_tokenizer: bool) -> None:
    """The request can be served to the end by this engine: in vocabulary, inside the context,
    and within the pool and token budget even at its longest -- otherwise it would wait in the
    queue forever (or be preempted forever), which is worse than an error now."""
    sched, vocab, max_len = config.scheduler, config.model.vocab_size, config.max_model_len
    if not ids:
        raise InvalidPromptError(f"request {rid!r}: the prompt is empty")
    if vocab is not None and (min(ids) < 0 or max(ids) >= vocab):
        raise InvalidPromptError(f"request {rid!r}: token ids must be in [0, {vocab})")
    if len(ids) >= max_len:
        raise InvalidPromptError(f"request {rid!r}: prompt of {len(ids)} tokens leaves no "
                                 f"room in the model's context of {max_len} tokens; shorten it")
    if params.n > sched.max_num_seqs:
        raise InvalidPromptError(f"n={params.n} exceeds max_num_seqs={sched.max_num_seqs}; "
                                 "lower n or raise max_num_seqs")
    if params.stop and not has_tokenizer:
        raise InvalidPromptError("stop strings need a tokenizer; use stop_token_ids instead")
    if sched.policy == "priority" and not is_int(priority):
        raise InvalidPromptError(f"priority must be an int, got {priority!r}")
    _check_capacity(config, rid, min(len(ids) + params.max_tokens, max_len))


def _check_capacity(config: EngineConfig, rid: str, total: int) -> None:
    sched, num_blocks, cache = config.scheduler, config.cache.num_blocks, config.cache
    slots = total + sched.num_lookahead_slots
    if cache.kv_group_windows is None:  # one block table
        need = cdiv(slots, cache.block_size)
    else:  # one table per group: a sliding group holds at most a window and a chunk
        chunk = (min(total, sched.max_num_batched_tokens) if sched.enable_chunked_prefill
                 else total) + sched.num_lookahead_slots
        need = sum(max_blocks_held(slots, cache.block_size, w, chunk)
                   for w in cache.kv_group_windows)
    if need > num_blocks:
        raise InvalidPromptError(
            f"request {rid!r} needs up to {need} KV blocks ({total} tokens) but the pool "
            f"has only {num_blocks}: it could never finish; raise "
            "num_blocks / kv_cache_bytes or lower max_tokens")
    if not sched.enable_chunked_prefill and total > sched.max_num_batched_tokens:
        raise InvalidPromptError(
            f"request {rid!r}: {total} tokens may need one prefill step but "
            f"max_num_batched_tokens={sched.max_num_batched_tokens}; enable chunked prefill "
            "or raise the budget")

"""Structured outputs (vLLM's ``StructuredOutputsParams``): JSON schema, regex, choice or grammar
constraints, enforced by masking the logits with xgrammar (an optional extra:
``pip install labkit[structured]``).

Why a mask and not a post-check: a grammar says which *characters* may come next, but the model
picks *tokens*, and a byte-level BPE token can span several grammar symbols (``'":'``, ``'},'``)
or stop in the middle of one. xgrammar precomputes, per grammar state, which of the vocabulary's
tokens keep the text inside the language; the matcher turns that into a bitmask (one bit per
token), and every token outside it gets ``-inf`` before sampling. Greedy and sampled rows alike
can then only pick valid tokens, and once the grammar is complete only EOS stays allowed, so
the request stops at the grammar's end through the ordinary EOS check.

How it plugs in: the engine compiles a request's grammar once at ``add_request``
(:class:`StructuredOutputManager`, cached by constraint) and hands the request a factory; every
sequence (sample) gets its own :class:`GrammarLogitsProcessor` from it. The runner applies a
sequence's processor to its logits row before sampling; the scheduler advances it with each
token it appends. Neither knows what the processor does.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from functools import partial
from typing import Any

import torch

from labkit.engine.sampling_params import StructuredOutputsParams
from labkit.errors import StructuredOutputsError

INSTALL_HINT = "structured outputs need xgrammar: pip install labkit[structured]"
GRAMMAR_CACHE_SIZE = 256  # compiled grammars kept (a server sees the same schema again and again)


def import_xgrammar() -> Any:
    """xgrammar, or a StructuredOutputsError that says how to install it."""
    try:
        import xgrammar
    except ImportError as e:
        raise StructuredOutputsError(f"{INSTALL_HINT} ({e})") from e
    return xgrammar


def encoded_vocab(tokenizer: Any, vocab_size: int) -> list[str]:
    """Every token id's string as the tokenizer stores it (byte-level: ``Ġ`` for a space).

    Ids past the tokenizer's vocabulary (a model's padded embedding) and special tokens map to
    "", which xgrammar treats as never allowed; the EOS ids are passed as stop tokens instead."""
    inner = getattr(tokenizer, "_tok", tokenizer)  # labkit's Tokenizer wraps a HF `tokenizers`
    special = {t.content for t in getattr(inner, "get_added_tokens_decoder", dict)().values()
               if getattr(t, "special", False)}
    vocab = []
    for i in range(vocab_size):
        s = tokenizer.id_to_token(i)
        vocab.append("" if s is None or s in special else s)
    return vocab


class StructuredOutputManager:
    """Compiles constraints for one tokenizer (vLLM's ``StructuredOutputManager``).

    The xgrammar compiler (which indexes the whole vocabulary) is built on the first structured
    request, so an engine that never sees one never imports xgrammar."""

    def __init__(self, tokenizer: Any, vocab_size: int | None, eos_token_ids: tuple[int, ...]
                 ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self._compiler: Any = None
        self._cache: OrderedDict[tuple, Any] = OrderedDict()

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            xgr = import_xgrammar()
            if self.tokenizer is None or self.vocab_size is None:
                raise StructuredOutputsError("structured outputs need the engine's tokenizer "
                                             "(the grammar is over its vocabulary)")
            vocab = encoded_vocab(self.tokenizer, self.vocab_size)
            info = xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.BYTE_LEVEL,
                                     vocab_size=self.vocab_size,
                                     stop_token_ids=self.eos_token_ids)
            self._compiler = xgr.GrammarCompiler(info)
        return self._compiler

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar for ``params`` (cached); StructuredOutputsError if invalid."""
        params.validate()
        key = params.key()
        if key in self._cache:
            self._cache.move_to_end(key)
            return self._cache[key]
        compiled = self._compile(params)
        self._cache[key] = compiled
        if len(self._cache) > GRAMMAR_CACHE_SIZE:
            self._cache.popitem(last=False)
        return compiled

    def _compile(self, p: StructuredOutputsParams) -> Any:
        c = self._get_compiler()
        kind = p.kind
        try:
            if kind in ("json", "json_object"):  # json_object: any object (OpenAI's, vLLM's)
                schema = '{"type": "object"}' if kind == "json_object" else p.json
                schema = schema if isinstance(schema, str) else json.dumps(schema)
                return c.compile_json_schema(schema, any_whitespace=not p.disable_any_whitespace)
            if kind == "regex":
                return c.compile_regex(p.regex)
            if kind == "choice":
                alts = " | ".join(json.dumps(s, ensure_ascii=False) for s in p.choice)
                return c.compile_grammar(f"root ::= {alts}")
            return c.compile_grammar(p.grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise StructuredOutputsError(f"invalid structured_outputs.{kind}: "
                                         f"{_clean(str(e))}") from e

    def logits_processor_factory(self, params: StructuredOutputsParams) -> partial:
        """A zero-argument factory of per-sequence processors for a request (compiled now)."""
        return partial(GrammarLogitsProcessor, self.compile(params), self.vocab_size,
                       tuple(self.eos_token_ids))


def _clean(msg: str) -> str:
    """xgrammar's C++ messages start with a timestamp and a source path: keep the reason."""
    lines = [ln.split("] ", 1)[-1].strip() for ln in msg.strip().splitlines() if ln.strip()]
    text = " ".join(lines)
    if ".cc:" in text:
        text = text.split(": ", 1)[-1]
    return text[:500]


class GrammarLogitsProcessor:
    """One sequence's grammar state: masks a logits row, advances with accepted tokens."""

    def __init__(self, compiled: Any, vocab_size: int, stop_token_ids: tuple[int, ...] = ()
                 ) -> None:
        xgr = import_xgrammar()
        self.stop_token_ids = list(stop_token_ids)
        self.matcher = xgr.GrammarMatcher(compiled)
        self.bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.vocab_size = vocab_size
        self._fill = self.matcher.fill_next_token_bitmask

    def allowed(self) -> torch.Tensor:
        """Bool [vocab_size]: the tokens the grammar allows next (unpacked from the bitmask).
        After the grammar's end (EOS accepted, yet the sequence goes on: ``ignore_eos``) only
        the stop tokens, which decode to no text: the output stays what the grammar made."""
        if self.matcher.is_terminated():
            out = torch.zeros(self.vocab_size, dtype=torch.bool)
            out[self.stop_token_ids] = True
            return out
        self._fill(self.bitmask)
        bits = (self.bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
        return bits.flatten()[:self.vocab_size].bool()

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        """A float32 copy of the row ``[V]`` with disallowed tokens at ``-inf``."""
        allowed = self.allowed().to(logits.device)
        row = logits.float()
        n = min(row.shape[-1], allowed.shape[0])
        out = torch.full_like(row, float("-inf"))
        out[:n] = row[:n].masked_fill(~allowed[:n], float("-inf"))
        return out

    def mask_draft_rows(self, logits: torch.Tensor, drafts: list[int]
                        ) -> tuple[torch.Tensor, int]:
        """The verify rows of a speculating sequence, each masked by the grammar state it is
        verified in: row j after the drafts ``drafts[:j]`` (speculative decoding).

        The drafts are accepted into the matcher one by one to reach those states, then rolled
        back: the scheduler advances the matcher with the tokens actually emitted, as for any
        step. A draft the grammar rejects ends the walk: with its row masked it has probability
        0, so the verifier rejects it anyway, and no state exists to mask the rows after it.
        Returns ``(rows [n+1, V] float32, n)``, ``n`` the drafts the grammar accepted."""
        rows = [self(logits[0])]
        n = 0
        for t in drafts:
            if self.matcher.is_terminated() or not self.matcher.accept_token(int(t)):
                break
            n += 1
            rows.append(self(logits[n]))
        if n:
            self.matcher.rollback(n)
        return torch.stack(rows), n

    def accept(self, token_ids: list[int]) -> None:
        """Advance by tokens the scheduler appended; a rejected one is a bug (the mask allowed
        it), so it raises rather than letting the output leave the grammar silently."""
        for t in token_ids:
            if self.matcher.is_terminated():
                return  # EOS accepted: nothing after it is generated
            if not self.matcher.accept_token(int(t)):
                raise RuntimeError(f"grammar rejected token {t} that its mask allowed")

    @property
    def is_terminated(self) -> bool:
        return self.matcher.is_terminated()

"""Exercise: chained prefix-block hashes and the longest-cached-prefix lookup.

Prefix caching (vLLM's automatic prefix caching, SGLang's radix cache) lets requests that share a
system prompt reuse its KV. A block's KV depends on every token before it, so its cache key must
cover the whole prefix: chain it, ``key_i = H(key_{i-1}, tokens of block i, extra keys)``.

Your hash values need not equal labkit's (``labkit.kv.prefix``); what must agree is *which* blocks
get equal keys: block i of two prompts must share a key exactly when labkit's keys are equal.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from labkit.engine.sampling_params import SamplingParams
from labkit.exercises.checks import CheckFailure, call, run_check, signature
from labkit.exercises.shared import tiny_engine
from labkit.kv.prefix import hash_prompt_blocks


def reference_longest_cached_prefix(hashes: list, num_tokens: int, block_size: int,
                                     cached: dict) -> list[int]:
    """The lookup rule of labkit's block manager (``BlockManager.find_cached_prefix``) on plain
    dicts: leading cached blocks, stopping at the first miss, never all ``num_tokens``."""
    limit = (num_tokens - 1) // block_size  # keep >= 1 token to compute
    blocks: list[int] = []
    for key in hashes[:limit]:
        if key not in cached:
            break
        blocks.append(cached[key])
    return blocks


def _pairs(rng: random.Random) -> list[tuple[list[int], list[int], int, Any, Any]]:
    """Prompt pairs designed to tell chaining, salts and partial blocks apart."""
    out = []
    for _ in range(60):
        bs = rng.choice([1, 2, 3, 4, 16])
        a = [rng.randrange(50) for _ in range(rng.randint(0, 5 * bs + 3))]
        kind = rng.random()
        b = list(a)
        if kind < 0.3 and a:  # same prompt except one token
            b[rng.randrange(len(b))] = 50 + rng.randrange(10)
        elif kind < 0.5:  # a shared prefix, then different continuations
            cut = rng.randint(0, len(a))
            b = a[:cut] + [rng.randrange(50) for _ in range(rng.randint(0, 3 * bs))]
        elif kind < 0.7 and len(a) >= 2 * bs:  # same later block, different earlier block
            b = [t + 100 for t in a[:bs]] + a[bs:]
        salt_a = rng.choice([None, None, "tenant-a"])
        salt_b = salt_a if rng.random() < 0.6 else rng.choice([None, "tenant-a", "tenant-b"])
        out.append((a, b, bs, salt_a, salt_b))
    return out


def check_hashes(block_hashes: Callable[..., list]) -> object:
    """Equal keys exactly where labkit's are equal, over prompt pairs built to expose mistakes."""

    def body() -> str:
        rng = random.Random(0)
        for a, b, bs, sa, sb in _pairs(rng):
            ha = call(block_hashes, a, bs, sa)
            hb = call(block_hashes, b, bs, sb)
            ra, rb = hash_prompt_blocks(a, bs, sa), hash_prompt_blocks(b, bs, sb)
            for toks, salt, mine, ref in ((a, sa, ha, ra), (b, sb, hb, rb)):
                if not isinstance(mine, list) or len(mine) != len(ref):
                    raise CheckFailure(
                        "wrong number of keys", inputs=signature("block_hashes", (toks, bs, salt),
                                                                 {}),
                        expected=f"a list of {len(ref)} keys", actual=_len(mine),
                        hint="one key per FULL block: len(token_ids) // block_size "
                             "(a partial last block is still being written, so it is not "
                             "cacheable).")
                again = call(block_hashes, list(toks), bs, salt)
                if again != mine:
                    raise CheckFailure("keys are not deterministic",
                                       inputs=signature("block_hashes", (toks, bs, salt), {}),
                                       expected=mine, actual=again,
                                       hint="the same prompt must give the same keys every call.")
                for k in mine:
                    try:
                        hash(k)
                    except TypeError:
                        raise CheckFailure("a key is not hashable", inputs=signature(
                            "block_hashes", (toks, bs, salt), {}), expected="hashable keys",
                            actual=k, hint="use a tuple, int, str or bytes, not a list.") from None
            for i in range(min(len(ra), len(rb))):
                if (ra[i] == rb[i]) != (ha[i] == hb[i]):
                    should = ra[i] == rb[i]
                    raise CheckFailure(
                        f"block {i} of two prompts should {'share' if should else 'NOT share'} "
                        "a key",
                        inputs=f"prompt A={a} salt={sa!r}\n            prompt B={b} salt={sb!r}"
                               f"\n            block_size={bs}",
                        expected="equal keys" if should else "different keys",
                        actual=f"A[{i}]={ha[i]!r}, B[{i}]={hb[i]!r}", hint=_hash_hint(
                            a, b, bs, sa, sb, i, should))
        return ("keys agree with labkit's prefix cache on 120 prompts. (labkit uses sha256 of a "
                "fixed-width encoding, not hash(): Python's 64-bit hash can collide, and a "
                "collision silently serves another prompt's KV.)")

    return run_check("block_hashes", body)


def _len(x: Any) -> str:
    return f"{type(x).__name__} of length {len(x)}" if hasattr(x, "__len__") else repr(x)


def _hash_hint(a: list, b: list, bs: int, sa: Any, sb: Any, i: int, should: bool) -> str:
    same_block = a[i * bs:(i + 1) * bs] == b[i * bs:(i + 1) * bs]
    if not should and sa != sb and a[:(i + 1) * bs] == b[:(i + 1) * bs]:
        return "the salts differ: the cache_salt must enter every key (tenant isolation)."
    if not should and same_block:
        return ("the blocks' own tokens are equal but an EARLIER block differs: chain the parent "
                "key into each block's key.")
    if should:
        return "equal prefixes and salts must give equal keys (no randomness, no object ids)."
    return "different tokens in this block must give different keys."


def _lookup_cases(rng: random.Random) -> list[tuple]:
    cases = [  # hand-written first: the two classic mistakes, then random ones
        (["h0", "h1", "h2"], 13, 4, {"h0": 7, "h2": 3}),     # hole at block 1: stop there
        (["h0", "h1"], 8, 4, {"h0": 5, "h1": 6}),             # fully cached, block-aligned
        (["h0", "h1"], 9, 4, {"h0": 5, "h1": 6}),             # fully cached + 1 token
        ([], 3, 4, {}),
        (["h0"], 1, 1, {"h0": 2}),
    ]
    for _ in range(200):
        bs = rng.choice([1, 2, 4, 16])
        n = rng.randint(1, 8 * bs)
        hashes = [f"k{j}" for j in range(n // bs)]
        cached = {h: rng.randrange(100) for h in hashes if rng.random() < 0.8}
        cases.append((hashes, n, bs, cached))
    return cases


def check_lookup(longest_cached_prefix: Callable[..., list[int]]) -> object:
    """Exact comparison with the reference on hand-written and random cache states."""

    def body() -> str:
        rng = random.Random(1)
        cases = _lookup_cases(rng)
        for hashes, n, bs, cached in cases:
            expected = reference_longest_cached_prefix(hashes, n, bs, cached)
            actual = call(longest_cached_prefix, list(hashes), n, bs, dict(cached))
            if actual != expected:
                raise CheckFailure(
                    "wrong blocks reused",
                    inputs=signature("longest_cached_prefix", (hashes, n, bs, cached), {}),
                    expected=expected, actual=actual, hint=_lookup_hint(hashes, n, bs, cached,
                                                                        expected, actual))
        return (f"{len(cases)} cache states right. A fully cached, block-aligned prompt still "
                "recomputes its last block: the engine needs the last token's logits.")

    return run_check("longest_cached_prefix", body)


def _lookup_hint(hashes: list, n: int, bs: int, cached: dict, expected: list, actual: Any) -> str:
    if isinstance(actual, list) and len(actual) > len(expected):
        if len(expected) < len(hashes) and hashes[len(expected)] not in cached:
            return "stop at the first key that is not cached; later hits cannot be used."
        return ("leave at least one token to compute: reuse at most (num_tokens - 1) // "
                "block_size blocks.")
    return "take every leading block whose key is cached, in order, as physical block ids."


def engine_prefix_hits(num_requests: int = 10, block_size: int = 4, seed: int = 0
                       ) -> list[dict[str, Any]]:
    """Serve requests one after another through labkit's engine (prefix caching on, a pool big
    enough that nothing is evicted) and record what its prefix cache reused for each."""
    engine = tiny_engine(block_size=block_size, num_blocks=256, max_num_seqs=4,
                         max_num_batched_tokens=64)
    rng = random.Random(seed)
    systems = [[rng.randrange(128) for _ in range(13)] for _ in range(2)]
    rows = []
    for i in range(num_requests):
        salt = "tenant-b" if i % 4 == 3 else None
        system = systems[i % 2] if i % 3 else systems[0][:6]
        prompt = system + [rng.randrange(128) for _ in range(rng.randint(1, 9))]
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=5,
                                                           ignore_eos=True), cache_salt=salt)
        output: list[int] = []
        while engine.has_unfinished_requests():
            for o in engine.step():
                output.extend(o.new_token_ids)
        timing = next(t for t in engine.request_timings() if t["request_id"] == f"r{i}")
        rows.append({"request_id": f"r{i}", "prompt": prompt, "output": output, "salt": salt,
                     "cached_tokens": timing["num_cached_tokens"]})
    return rows


def check_on_engine(block_hashes: Callable[..., list],
                    longest_cached_prefix: Callable[..., list[int]]) -> object:
    """Your two functions predict, request by request, how many prompt tokens labkit's engine
    took from its prefix cache. The cache holds every full block whose KV was computed: the
    prompt and all generated tokens but the last (its KV is never written)."""

    def body() -> str:
        rows = engine_prefix_hits()
        cached: dict = {}
        total = 0
        for r in rows:
            prompt, salt = r["prompt"], r["salt"]
            keys = call(block_hashes, list(prompt), 4, salt)
            blocks = call(longest_cached_prefix, keys, len(prompt), 4, dict(cached))
            predicted = 4 * len(blocks)
            if predicted != r["cached_tokens"]:
                raise CheckFailure(
                    f"request {r['request_id']}: your prediction differs from the engine's "
                    "prefix cache", inputs=f"prompt={prompt}, cache_salt={salt!r}, block_size=4",
                    expected=f"{r['cached_tokens']} cached prompt tokens",
                    actual=f"{predicted} ({len(blocks)} blocks)",
                    hint="salted and unsalted keys of the same tokens must differ; equal "
                         "prefixes with equal salts must match across requests.")
            total += predicted
            for j, key in enumerate(call(block_hashes, prompt + r["output"][:-1], 4, salt)):
                cached.setdefault(key, j)
        return (f"your hashes and lookup predict exactly what labkit's engine reused for all "
                f"{len(rows)} requests ({total} prompt tokens served from the prefix cache).")

    return run_check("longest_cached_prefix", body, record=False)

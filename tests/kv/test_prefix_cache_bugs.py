"""Three prefix-cache bugs reported against nano-vllm, and whether labkit's cache survives them:

(a) a fully cached prompt leaving zero tokens to compute (no logits to sample the next token);
(b) a stale hash entry pointing at a block that was freed and reused for other content (a hit
    must never hand back a block whose content changed);
(c) two identical prefixes admitted in the same step: each computes its own copy (nothing is
    published before its KV exists); one copy is published, the other stays private and is
    freed, not cached and not leaked.

Each is tested on the block manager with a shadow of the KV contents, through ``labkit.LLM``
against the reference ``generate``, and through the scenarios notebook 03 runs, with the bug put
back into the engine as a negative control (the scenario must then fail)."""

from __future__ import annotations

import pytest
from test_block_pool import FakeSeq  # the block manager tests' stand-in sequence

from labkit.engine.invariants import assert_no_leaks
from labkit.engine.llm import LLM
from labkit.engine.sampling_params import SamplingParams
from labkit.exercises import prefix_cache_bugs as prefix_cache
from labkit.kv.block_manager import BlockManager
from labkit.kv.prefix import hash_prompt_blocks
from labkit.model import testing
from labkit.model.generate import generate

MAX_NEW = 6


@pytest.fixture(scope="module")
def tiny_model():
    return testing.tiny_model()


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Greedy tokens of the reference ``generate`` (no cache at all), memoised."""
    cache: dict = {}

    def ref(prompt, max_new, **kw):
        key = (tuple(prompt), max_new, tuple(sorted(kw.items())))
        if key not in cache:
            cache[key] = generate(tiny_model, prompt, max_new, **kw)
        return cache[key]

    return ref


class Shadow:
    """The block manager plus what each physical block holds (token per slot)."""

    def __init__(self, num_blocks: int, block_size: int):
        self.bm = BlockManager(num_blocks, block_size)
        self.bs = block_size
        self.contents: dict[int, list[int | None]] = {}

    def admit(self, seq: FakeSeq) -> list[int]:
        """Prefix lookup + allocation for the whole prompt (not computed yet); returns the hits
        after checking each hit block holds exactly this prompt's tokens."""
        blocks, hashes = self.bm.find_cached_prefix(seq)
        assert len(blocks) * self.bs <= len(seq.token_ids) - 1, "at least one token to compute"
        for i, b in enumerate(blocks):
            assert self.contents[b] == seq.token_ids[i * self.bs:(i + 1) * self.bs], \
                f"hit block {b} holds other tokens: a stale prefix-cache entry"
        num_new = len(seq.token_ids) - len(blocks) * self.bs
        assert num_new >= 1
        assert self.bm.allocate_slots(seq, num_new, blocks, hashes)
        return blocks

    def compute(self, seq: FakeSeq) -> None:
        """The forward pass: write every uncomputed token's KV, then publish full blocks."""
        for p in range(seq.num_computed_tokens, len(seq.token_ids)):
            b = seq.block_table[p // self.bs]
            self.contents.setdefault(b, [None] * self.bs)[p % self.bs] = seq.token_ids[p]
        seq.num_computed_tokens = len(seq.token_ids)
        self.bm.cache_full_blocks(seq)

    def check_index(self) -> None:
        pool = self.bm.pool
        for h, b in pool.hash_to_block.items():
            assert pool.block_hash[b] == h
        for b, h in enumerate(pool.block_hash):
            assert h is None or pool.hash_to_block[h] == b
        assert pool.num_used + pool.num_free + pool.num_cached == pool.num_blocks


# ---- (a) a fully cached prompt ------------------------------------------------------------------

@pytest.mark.parametrize("bs", [1, 4, 16])
def test_fully_cached_prompt_still_computes_its_last_token(bs):
    for n in range(1, 3 * bs + 2):
        sh = Shadow(num_blocks=16, block_size=bs)
        tokens = [(7 * i + 1) % 50 for i in range(n)]
        first = FakeSeq("first", tokens)
        sh.admit(first)
        sh.compute(first)
        sh.bm.free(first)
        again = FakeSeq("again", list(tokens))
        hits = sh.admit(again)
        assert len(hits) == (n - 1) // bs  # every full block but one that holds the last token
        assert len(tokens) - again.num_computed_tokens >= 1
        sh.compute(again)
        sh.check_index()


def test_fully_cached_prompts_through_llm(tiny_model, reference):
    llm = LLM.from_model(tiny_model, None, block_size=4, num_blocks=64)
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    p = [(5 * i + 2) % 128 for i in range(8)]  # two full blocks
    out0 = llm.generate(prompt_token_ids=[p], sampling_params=sp)[0].outputs[0].token_ids
    # the prompt again; extended by its own output (whose KV was cached too), block-aligned and
    # leaving exactly one token; a one-token prompt
    cases = [(p, 4), (p + out0[:4], 8), (p + out0[:5], 12), ([p[0]], 0)]
    for prompt, cached in cases:
        o = llm.generate(prompt_token_ids=[prompt], sampling_params=sp)[0]
        assert o.num_cached_tokens == cached
        assert o.outputs[0].token_ids == reference(prompt, MAX_NEW, ignore_eos=True)
    assert_no_leaks(llm.llm_engine)


# ---- (b) a stale entry for a freed and reused block ---------------------------------------------

@pytest.mark.parametrize("other_len", [6, 8, 10])  # B evicts A's tail, 2 of 3 blocks, all 3
def test_reused_block_is_never_a_hit(other_len):
    sh = Shadow(num_blocks=5, block_size=2)
    a = [1, 2, 3, 4, 5, 6, 7]  # 3 full blocks published, the partial one freed
    first = FakeSeq("a", a)
    sh.admit(first)
    sh.compute(first)
    a_blocks = list(first.block_table[:3])
    sh.bm.free(first)
    b = FakeSeq("b", [40 + i for i in range(other_len)])
    sh.admit(b)
    sh.compute(b)
    reused = [x for x in a_blocks if x in b.block_table]
    assert reused, "B must take over some of A's cached blocks for the scenario to happen"
    assert len(reused) == (other_len - 4) // 2  # least recently freed first: A's tail
    sh.check_index()
    sh.bm.free(b)  # B's blocks are published now: A again may evict those, never use them
    again = FakeSeq("a2", list(a))
    hits = sh.admit(again)  # Shadow.admit asserts every hit holds A's tokens
    assert not set(hits) & set(reused)
    assert hits == a_blocks[:3 - len(reused)]  # the chain stops at the first evicted block
    sh.compute(again)
    sh.bm.free(again)
    sh.check_index()


def test_reset_prefix_cache_leaves_no_entry():
    sh = Shadow(num_blocks=4, block_size=2)
    s = FakeSeq("a", [1, 2, 3, 4, 5])
    sh.admit(s)
    sh.compute(s)
    sh.bm.free(s)
    sh.bm.pool.reset_prefix_cache()
    assert not sh.bm.pool.hash_to_block and sh.bm.pool.num_free == 4
    assert sh.admit(FakeSeq("a2", [1, 2, 3, 4, 5])) == []
    sh.check_index()


def test_eviction_and_reuse_through_llm(tiny_model, reference):
    llm = LLM.from_model(tiny_model, None, block_size=4, num_blocks=8, max_num_seqs=2)
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    a = [(5 * i + 1) % 128 for i in range(10)]
    b = [(11 * i + 60) % 128 for i in range(20)]
    outs = [llm.generate(prompt_token_ids=[p], sampling_params=sp)[0] for p in (a, b, a)]
    eng = llm.llm_engine
    assert eng.stats()["num_evictions"] >= 2
    assert outs[2].num_cached_tokens == 4  # A's root block survived, its evicted tail did not
    for p, o in zip((a, b, a), outs):
        assert o.outputs[0].token_ids == reference(p, MAX_NEW, ignore_eos=True)
    assert_no_leaks(eng)


# ---- (c) identical prefixes admitted in the same step -------------------------------------------

def test_same_step_twins_publish_one_copy_and_free_the_other():
    sh = Shadow(num_blocks=12, block_size=4)
    p = list(range(10, 24))  # 14 tokens: 3 full blocks
    t1, t2 = FakeSeq("t1", p), FakeSeq("t2", list(p))
    assert sh.admit(t1) == [] and sh.admit(t2) == []  # same step: nothing published yet
    sh.compute(t1)
    sh.compute(t2)
    pool = sh.bm.pool
    keys = hash_prompt_blocks(p, 4)
    assert [pool.lookup(k) for k in keys] == t1.block_table[:3]
    assert all(pool.block_hash[x] is None for x in t2.block_table)  # the duplicates stay private
    assert t2.block_hashes == keys  # ...though t2 knows its chain (its next blocks chain on)
    sh.check_index()
    t3 = FakeSeq("t3", list(p))
    assert sh.admit(t3) == t1.block_table[:3]  # a later request shares the published copy
    sh.compute(t3)
    for s in (t1, t2, t3):
        sh.bm.free(s)
    assert pool.num_used == 0 and pool.num_cached == 3  # t2's copies went back to the free list
    assert pool.num_free == 12 - 3
    sh.check_index()


def test_same_step_twins_through_llm(tiny_model, reference):
    llm = LLM.from_model(tiny_model, None, block_size=4, num_blocks=16, max_num_seqs=4)
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    p = [(3 * i + 9) % 128 for i in range(14)]
    q = p[:8] + [100, 101, 102, 103, 104, 105]
    outs = llm.generate(prompt_token_ids=[p, list(p), q], sampling_params=sp)
    eng = llm.llm_engine
    assert {s["request_id"] for s in eng.trace.steps[0]["scheduled"]} == {
        o.request_id for o in outs}, "all three admitted in the first step"
    for prompt, o in zip((p, p, q), outs):
        assert o.outputs[0].token_ids == reference(prompt, MAX_NEW, ignore_eos=True)
    assert_no_leaks(eng)
    pool = eng.block_manager.pool
    assert all(pool.hash_to_block[h] == b for b, h in enumerate(pool.block_hash) if h)
    later = llm.generate(prompt_token_ids=[p], sampling_params=sp)[0]
    assert later.num_cached_tokens == 12
    assert later.outputs[0].token_ids == reference(p, MAX_NEW, ignore_eos=True)


# ---- the scenarios notebook 03 runs, and their negative controls --------------------------------

@pytest.mark.parametrize("name", list(prefix_cache.SCENARIOS))
def test_scenario_survives(name):
    result = prefix_cache.SCENARIOS[name]()
    assert result.survived, str(result)
    assert "every output = the reference" in result.evidence


@pytest.mark.parametrize("name", list(prefix_cache.SCENARIOS))
def test_scenario_catches_its_bug(name):
    """Negative control: the reported bug, put back into one engine, fails its scenario."""
    result = prefix_cache.SCENARIOS[name](prefix_cache.BUG_PATCHES[name])
    assert not result.survived and result.problems, str(result)


def test_reset_prefix_cache_refuses_while_blocks_are_held_then_forgets_everything():
    """vLLM's LLM.reset_prefix_cache(): False and no change while a request holds blocks (their
    keys would survive the reset); True once idle, after which nothing hits."""
    import labkit

    llm = labkit.LLM("labkit-tiny", dtype="float32", block_size=8, num_blocks=64)
    eng = llm.llm_engine
    prompt = llm.tokenizer.encode("# a shared system prompt for every request\n" * 2)
    sp = labkit.SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate(prompt_token_ids=[prompt], sampling_params=sp)
    pool = eng.block_manager.pool
    keys = dict(pool.hash_to_block)
    assert keys and pool.num_cached > 0
    eng.add_request("held", prompt, sp)
    eng.step()  # the request now holds blocks (its prefix hit the cache)
    assert pool.num_used > 0
    assert llm.reset_prefix_cache() is False and pool.hash_to_block == keys  # nothing changed
    while eng.has_unfinished_requests():
        eng.step()
    assert llm.reset_prefix_cache() is True
    assert pool.num_cached == 0 and not pool.hash_to_block
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=sp)[0]
    assert out.num_cached_tokens == 0

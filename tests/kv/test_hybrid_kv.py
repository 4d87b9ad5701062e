"""Sliding-window block freeing (labkit.kv.hybrid, BlockManager.remove_skipped_blocks): blocks
freed against the rule derived from the mask, the engine's greedy output against the reference
with windows shorter than the prompts, and the per-group byte accounting by hand."""

from __future__ import annotations

import pytest
import torch

from labkit.engine.invariants import assert_no_leaks, check_kv_invariants
from labkit.engine.llm_engine import LLMEngine
from labkit.engine.sampling_params import SamplingParams
from labkit.kv.block_manager import BlockManager
from labkit.kv.hybrid import (
    NULL_BLOCK,
    freeable_window,
    group_kv_bytes,
    kv_cache_groups,
    peak_blocks,
)
from labkit.model.generate import generate
from labkit.model.testing import tiny_config, tiny_model

MISTRAL = dict(sliding_window=6, architecture="MistralForCausalLM")


class Seq:
    def __init__(self, tokens):
        self.seq_id = self.request_id = "s"
        self.token_ids = list(tokens)
        self.num_computed_tokens = 0
        self.block_table, self.cpu_block_table, self.block_hashes = [], [], []
        self.cache_salt = None


def dead_blocks_by_mask(n: int, window: int, bs: int, num_blocks: int) -> int:
    """Leading blocks none of whose keys any query q >= n sees (q - w < k <= q), by brute
    force over the mask rather than the closed form."""
    dead = 0
    for b in range(num_blocks):
        keys = range(b * bs, (b + 1) * bs)
        if any(q - window < k <= q for k in keys for q in range(n, n + window + bs)):
            break
        dead += 1
    return dead


@pytest.mark.parametrize("bs,window", [(1, 1), (2, 6), (3, 4), (4, 5), (16, 6)])
def test_blocks_freed_match_the_mask(bs, window):
    bm = BlockManager(64, bs, enable_prefix_caching=False, sliding_window=window)
    seq = Seq(range(40))
    freed_total = 0
    for n in range(40):  # one token per step, as decoding
        assert bm.allocate_slots(seq, 1)
        dead = dead_blocks_by_mask(n, window, bs, len(seq.block_table))
        assert seq.block_table[:dead] == [NULL_BLOCK] * dead
        assert NULL_BLOCK not in seq.block_table[dead:]
        freed_total = dead
        seq.num_computed_tokens += 1
        assert bm.pool.num_used == len(seq.block_table) - dead
    assert bm.num_window_freed == freed_total > 0
    bm.free(seq)
    assert bm.pool.num_used == 0


def test_groups_and_freeable_window():
    mixed = tiny_config(num_hidden_layers=3, sliding_window=5,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    assert [(g.kind, g.sliding_window, g.layers) for g in kv_cache_groups(mixed)] == [
        ("sliding", 5, (0, 2)), ("full", None, (1,))]
    assert freeable_window(mixed) is None  # one table: the full layer needs every block
    assert freeable_window(tiny_config(**MISTRAL)) == 6
    assert freeable_window(tiny_config()) is None


def test_group_bytes_by_hand():
    """Tiny Mistral, window 6, block 2, fp32: a block is 2 layers x (K, V) x 2 tokens x 2 KV
    heads x 16 x 4 bytes = 1024 bytes. 30 tokens hold 15 blocks; freeing, at most 4 (writing an
    even position n, keys n-5 .. n span 4 blocks)."""
    c = tiny_config(**MISTRAL)
    assert peak_blocks(30, 2, 6) == 4
    assert group_kv_bytes(c, 30, 2, torch.float32, False) == {"sliding_6": 15 * 1024}
    assert group_kv_bytes(c, 30, 2, torch.float32, True) == {"sliding_6": 4 * 1024}


def run_engine(model, prompts, sp, **kw):
    eng = LLMEngine.from_model(model, None, **kw)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, sp)
    while eng.has_unfinished_requests():
        eng.step()
        check_kv_invariants(eng)
    return eng


@pytest.mark.parametrize("kw", [
    dict(block_size=2, num_blocks=60),
    dict(block_size=4, num_blocks=40, enable_chunked_prefill=True, max_num_batched_tokens=7),
    dict(block_size=3, num_blocks=26, preemption_mode="swap", num_cpu_blocks=40),
    dict(block_size=1, num_blocks=70, max_num_seqs=2),
])
def test_engine_greedy_matches_reference_with_short_window(kw):
    """Prompts of 9..30 tokens against a window of 6: blocks are freed, n=2 forks share the
    freed tables, prefix caching reuses the shared start, and every token equals generate."""
    model = tiny_model(0, **MISTRAL)
    shared = list(range(10, 22))
    prompts = [shared + [3, 4, 5], shared + list(range(40, 58)), list(range(60, 69)), shared]
    sp = SamplingParams(n=2, temperature=0, max_tokens=14, ignore_eos=True)
    eng = run_engine(model, prompts, sp, enable_prefix_caching=True, **kw)
    for i, p in enumerate(prompts):
        want = generate(model, p, 14, ignore_eos=True)
        assert [s.output_token_ids for s in eng.requests[f"r{i}"].seqs] == [want, want]
    assert eng.block_manager.sliding_window == 6
    assert eng.block_manager.num_window_freed > 0
    assert_no_leaks(eng)


def test_one_table_frees_nothing_for_mixed_layers_or_speculation():
    """One table per sequence cannot free for a mixed model (the full layer needs every
    block): that takes per-group tables (tests/kv/test_hybrid_manager.py), or nothing."""
    mixed = tiny_model(2, num_hidden_layers=3, sliding_window=5,
                       layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    eng = LLMEngine.from_model(mixed, None, disable_hybrid_kv_cache_manager=True)
    assert isinstance(eng.block_manager, BlockManager)
    assert eng.block_manager.sliding_window is None
    spec = LLMEngine.from_model(tiny_model(0, **MISTRAL), None, speculative_config={
        "method": "ngram", "num_speculative_tokens": 2})
    assert spec.block_manager.sliding_window is None


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="sliding_window"):
        BlockManager(8, 2, sliding_window=0)


def test_no_freeing_with_a_kv_connector(tmp_path):
    eng = LLMEngine.from_model(tiny_model(0, **MISTRAL), None, kv_transfer_config={
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"cpu_bytes": 1 << 20}})
    assert eng.block_manager.sliding_window is None


def decode_all(bm, seq):
    """Compute the sequence one token per step, publishing full blocks as the engine does."""
    for _ in range(len(seq.token_ids)):
        assert bm.allocate_slots(seq, 1)
        seq.num_computed_tokens += 1
        bm.cache_full_blocks(seq)


def test_window_hit_survives_evicted_root_blocks():
    """bs 2, window 4: A's 30 tokens fill 15 blocks, all published. Its dead root blocks were
    freed first, so the root is evicted first and the chain a full-attention hit walks from
    block 0 is broken; the window lookup still hits all 15 blocks (30 tokens of B's 31), holding
    only the live tail, blocks 13 and 14 (keys 26..29: what a query at 30 sees, 30 - 4 < k)."""
    bm = BlockManager(20, 2, sliding_window=4)
    a = Seq(range(30))
    decode_all(bm, a)
    bm.free(a)
    hog = Seq(range(100, 112))  # 6 fresh blocks: 5 free ones, then the oldest cached one
    assert bm.allocate_slots(hog, 12)
    assert bm.pool.num_evictions == 1
    b = Seq(list(range(30)) + [7])
    blocks, hashes = bm.find_cached_prefix(b)
    assert bm.pool.lookup(hashes[0]) is None  # the root: a full-attention hit would be empty
    assert len(blocks) == len(hashes) == 15
    assert blocks[:13] == [NULL_BLOCK] * 13  # dead at 30 computed: (30 - 4 + 1) // 2 = 13
    assert NULL_BLOCK not in blocks[13:]
    assert bm.allocate_slots(b, 1, blocks, hashes)
    assert b.num_computed_tokens == 30 and b.block_table[:13] == [NULL_BLOCK] * 13
    assert bm.pool.ref_counts[blocks[13]] == 1 and bm.pool.ref_counts[blocks[14]] == 1


def test_engine_prefix_hit_holds_only_the_window():
    """A second request repeating a finished one's 30-token prompt hits 15 blocks (bs 2) but
    takes only the 3 its window of 6 still sees ((30 - 6 + 1) // 2 = 12 dead); tokens equal
    generate's."""
    model = tiny_model(0, **MISTRAL)
    eng = LLMEngine.from_model(model, None, block_size=2, num_blocks=60)
    p = list(range(10, 40))
    sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    for rid, prompt in (("a", p), ("b", p + [3, 4])):
        eng.add_request(rid, prompt, sp)
        while eng.has_unfinished_requests():
            eng.step()
            check_kv_invariants(eng)
        assert eng.requests[rid].seqs[0].output_token_ids == \
            generate(model, prompt, 6, ignore_eos=True)
    hits = [e for st in eng.trace.steps for e in st["events"] if e["type"] == "prefix_hit"]
    assert eng.stats()["prefix_hit_tokens"] == 30 and len(hits) == 3
    assert_no_leaks(eng)


@pytest.mark.slow
def test_triton_backend_reads_no_freed_block():
    """The Triton kernels (interpreter on CPU) over tables with NULL_BLOCK entries: the
    metadata hands them block 0, the window masks it, tokens equal generate's."""
    import os

    if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("CPU tensors through Triton need TRITON_INTERPRET=1")
    model = tiny_model(0, **MISTRAL)
    prompts = [list(range(10, 26)), list(range(30, 41))]
    sp = SamplingParams(n=1, temperature=0, max_tokens=6, ignore_eos=True)
    eng = run_engine(model, prompts, sp, block_size=4, num_blocks=30, enable_chunked_prefill=True,
                     max_num_batched_tokens=7, attention_backend="triton")
    assert eng.executor.kv_cache.backend.name == "triton"
    assert eng.block_manager.num_window_freed > 0
    for i, p in enumerate(prompts):
        assert eng.requests[f"r{i}"].seqs[0].output_token_ids == \
            generate(model, p, 6, ignore_eos=True)
    assert_no_leaks(eng)

"""The per-group page-table widget on a tiny gpt-oss-like model (sliding and full layers 1:1,
window 6): at every step its tables equal the coordinator's own block tables read off the live
engine, their live entries equal the trace's block events replayed, and at each request's last
running step the sliding group holds exactly the blocks the window rule of labkit.kv.hybrid
leaves (no more than the window needs), while the full group holds them all."""

from __future__ import annotations

import pytest

from labkit.engine.llm import LLM
from labkit.engine.llm_engine import LLMEngine
from labkit.engine.sampling_params import SamplingParams
from labkit.engine.trace import replay
from labkit.kv.hybrid import NULL_BLOCK, max_blocks_held, num_skipped_blocks
from labkit.kv.hybrid_manager import KVCacheCoordinator, group_block_tables
from labkit.model.testing import tiny_model
from labkit.utils import cdiv
from labkit.viz.kv_groups import GROUP_COLORS, NULL_COLOR, KVGroupsWidget, watch_kv_groups

S, F = "sliding_attention", "full_attention"
GPT_OSS = dict(num_hidden_layers=4, sliding_window=6, layer_types=[S, F, S, F])
BS, WINDOW = 2, 6


@pytest.fixture(scope="module")
def run():
    """(engine, the coordinator's tables after each step read off the live sequences)."""
    eng = LLMEngine.from_model(tiny_model(3, **GPT_OSS), None, block_size=BS, num_blocks=60)
    assert isinstance(eng.block_manager, KVCacheCoordinator)
    watch_kv_groups(eng)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    for i, p in enumerate([list(range(10, 31)), list(range(40, 54))]):
        eng.add_request(f"r{i}", p, sp)
    live = []
    while eng.has_unfinished_requests():
        eng.step()
        seqs = [s for r in eng.requests.values() for s in r.seqs]
        live.append({s.seq_id: [list(t) for t in group_block_tables(s)] for s in seqs
                     if any(group_block_tables(s))})
    return eng, live


def test_tables_equal_the_coordinators_at_every_step(run):
    eng, live = run
    w = KVGroupsWidget(eng)
    assert [g["name"] for g in w.groups] == ["sliding_6", "full"]
    assert w.slider.max == len(live) - 1 == len(eng.trace.steps) - 1
    for step, want in enumerate(live):
        assert w.group_tables(step) == want, step
        # the live entries are what the block events say (group g >= 1 under "<seq>/g<g>")
        snap = replay(eng.trace, step)
        for seq, tables in want.items():
            for g, table in enumerate(tables):
                view = seq if g == 0 else f"{seq}/g{g}"
                assert [b for b in table if b != NULL_BLOCK] == snap.block_tables.get(view, [])


def test_sliding_group_holds_only_what_the_window_needs_at_the_last_step(run):
    eng, live = run
    w = KVGroupsWidget(eng)
    steps = eng.trace.steps
    for seq in ("r0", "r1"):
        last = max(i for i, tables in enumerate(live) if seq in tables)
        sched = next(s for s in steps[last]["scheduled"] if s["seq_id"] == seq)
        assert sched["phase"] == "decode" and sched["num_tokens"] == 1
        n0 = sched["start_pos"]  # computed before this step; n0 + 1 after
        sliding, full = w.group_tables(last)[seq]
        held = sum(b != NULL_BLOCK for b in sliding)
        assert held == cdiv(n0 + 1, BS) - num_skipped_blocks(n0, WINDOW, BS)
        assert held <= max_blocks_held(n0 + 1, BS, WINDOW, chunk=1) < len(full)
        assert sliding[:len(sliding) - held] == [NULL_BLOCK] * (len(sliding) - held)
        assert NULL_BLOCK not in full and len(full) == cdiv(n0 + 1, BS)
    assert eng.block_manager.num_window_freed > 0


def test_the_drawing_follows_the_slider(run):
    eng, live = run
    w = KVGroupsWidget(eng, step=0)
    last = max(i for i, t in enumerate(live) if t)
    w.slider.value = last
    fig = w.figure
    sliding_trace, full_trace = fig.data[1], fig.data[2]
    tables = w.group_tables(last)
    nulls = sum(t[0].count(NULL_BLOCK) for t in tables.values())
    assert nulls > 0 and list(sliding_trace.marker.color).count(NULL_COLOR) == nulls
    assert NULL_COLOR not in full_trace.marker.color
    pool = list(fig.data[0].marker.color)
    for tables_of_seq in tables.values():
        for g, table in enumerate(tables_of_seq):
            for b in table:
                if b != NULL_BLOCK:
                    assert pool[b] == GROUP_COLORS[g]
    assert [list(h) for h in w.held_over_steps] == [w.held(i) for i in range(len(live))]
    assert f"step {last}" in w.summary.value and "group 0 sliding_6: holds" in w.summary.value
    w.prev_button.click()
    assert w.slider.value == last - 1


def test_a_run_without_the_probe_is_refused_by_name():
    llm = LLM.from_model(tiny_model(3, **GPT_OSS), block_size=BS, num_blocks=40)
    llm.generate(prompt_token_ids=[list(range(10, 20))],
                 sampling_params=SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    with pytest.raises(ValueError, match="watch_kv_groups"):
        KVGroupsWidget(llm)

"""``labkit bench ops cpu-tuning``'s workers, in this process with tiny sizes (the command runs
each in a fresh process per thread count)."""

from __future__ import annotations

from labkit.bench.ops import describe
from labkit.bench.ops_cpu import QUICK, budget_worker, thread_worker

TINY = {**QUICK, "prompt_len": 48, "new_tokens": 4, "repeats": 1, "mixed_prompts": 2,
        "mixed_prompt_len": 96, "mixed_decoders": 2}


def test_thread_worker_measures_prefill_and_decode():
    row = thread_worker(1, TINY)
    assert row["threads"] == 1
    assert all(row[k] > 0 for k in ("labkit_prefill_tok_s", "labkit_decode_b1_tok_s",
                                    "labkit_decode_b8_tok_s"))


def test_budget_worker_chunks_prefill_beside_running_decodes():
    """A 32-token budget cuts each 96-token prompt into 3+ chunks: the prompts take several
    steps, each a decode gap; every decoder is aborted and its blocks freed at the end."""
    import labkit.bench.ops_cpu as m

    made = []
    real = m._llm
    m._llm = lambda **kw: made.append(real(**kw)) or made[-1]
    try:
        row = budget_worker(32, TINY)
    finally:
        m._llm = real
    assert row["budget"] == 32 and row["prefill_tok_s"] > 0
    assert row["steps"] >= 2 * 96 // (32 - 2)  # two prompts, 30 prompt tokens a step at most
    assert 0 < row["decode_itl_p50_ms"] <= row["decode_itl_max_ms"]
    eng = made[0].llm_engine
    assert not eng.has_unfinished_requests()
    pool = eng.block_manager.pool
    assert pool.num_used == 0


def test_listed():
    assert any(line.startswith("cpu-tuning:") for line in describe())

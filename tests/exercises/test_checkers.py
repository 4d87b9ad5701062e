"""Every reference solution passes its checker; every deliberately wrong one is caught with a
message that names the mistake (negative controls)."""

import pytest
import torch
import wrong_answers as W

from labkit.exercises import (
    allocator,
    kv_size,
    latency,
    prefix_cache,
    quantization,
    scheduler_step,
    speculative,
)
from labkit.exercises import solutions as S

PASSING = [
    ("kv_cache_bytes", lambda: kv_size.check(S.kv_cache_bytes)),
    ("block_allocator", lambda: allocator.check(S.BlockAllocator)),
    ("block_hashes", lambda: prefix_cache.check_hashes(S.block_hashes)),
    ("longest_cached_prefix", lambda: prefix_cache.check_lookup(S.longest_cached_prefix)),
    ("schedule_step", lambda: scheduler_step.check(S.schedule_step)),
    ("latency_metrics", lambda: latency.check(S.latency_metrics)),
    ("int8", lambda: quantization.check_int8(S.quantize_int8_per_channel, S.dequantize_int8)),
    ("int4", lambda: quantization.check_int4(S.quantize_int4_groupwise,
                                             S.dequantize_int4_groupwise)),
    ("nf4", lambda: quantization.check_nf4(S.nf4_quantize, S.nf4_dequantize)),
    ("spec_accept", lambda: speculative.check_accept(S.accept_or_resample)),
    ("spec_speedup", lambda: speculative.check_speedup(S.expected_tokens_per_step,
                                                       S.expected_speedup)),
]


@pytest.mark.parametrize("name,run", PASSING, ids=[p[0] for p in PASSING])
def test_reference_solution_passes(name, run, capsys):
    result = run()
    assert result.passed, result.message
    assert result.message.startswith("✓")
    assert "✓" in capsys.readouterr().out


# (checker call, substrings the failure message must contain)
WRONG = [
    ("kv: query heads", lambda: kv_size.check(W.kv_bytes_uses_query_heads),
     ["num_kv_heads", "expected: 536870912", "actual:   2147483648"]),
    ("kv: forgets V", lambda: kv_size.check(W.kv_bytes_forgets_v), ["factor 2"]),
    ("kv: assumes fp16", lambda: kv_size.check(W.kv_bytes_assumes_fp16),
     ["torch.float32 takes 4 byte(s)"]),
    ("alloc: no ref decrement", lambda: allocator.check(W.AllocatorNoRefDecrement),
     ["ref_count(", "fork('", "free('"]),
    ("alloc: off by one", lambda: allocator.check(W.AllocatorOffByOne),
     ["len(block_table(", "ceil(n / block_size)"]),
    ("alloc: no copy-on-write", lambda: allocator.check(W.AllocatorNoCopyOnWrite),
     ["append_token(", "copy-on-write"]),
    ("alloc: partial allocation on OOM", lambda: allocator.check(W.AllocatorPartialOnOOM),
     ["-> MemoryError", "no live sequence holds", "ref count 0"]),
    ("alloc: swapped copy-on-write pair", lambda: allocator.check(W.AllocatorSwappedCowPair),
     ["append_token(", "return value is wrong", "the pair is swapped", "copies src -> dst"]),
    ("alloc: allocate returns nothing",
     lambda: allocator.check(W.AllocatorAllocateReturnsNothing),
     ["allocate(", "return value is wrong", "actual:   None", "returns the new sequence's block"]),
    ("hash: not chained", lambda: prefix_cache.check_hashes(W.hashes_not_chained),
     ["should NOT share", "chain the parent key"]),
    ("hash: ignores salt", lambda: prefix_cache.check_hashes(W.hashes_ignore_salt),
     ["salts differ", "tenant"]),
    ("hash: partial block", lambda: prefix_cache.check_hashes(W.hashes_include_partial_block),
     ["wrong number of keys", "FULL block"]),
    ("lookup: skips holes", lambda: prefix_cache.check_lookup(W.lookup_skips_holes),
     ["expected: [7]", "actual:   [7, 3]", "first key that is not cached"]),
    ("lookup: reuses everything", lambda: prefix_cache.check_lookup(W.lookup_reuses_everything),
     ["at least one token", "expected: [5]"]),
    ("sched: prefill first", lambda: scheduler_step.check(W.schedule_prefill_first),
     ["decodes come first", "expected: {'b': 1, 'a': 3}"]),
    ("sched: no chunking", lambda: scheduler_step.check(W.schedule_no_chunking),
     ["chunked prefill", "'w0': 7"]),
    ("sched: max seqs", lambda: scheduler_step.check(W.schedule_max_seqs_off_by_one),
     ["max_num_seqs"]),
    ("latency: tpot / n", lambda: latency.check(W.latency_tpot_divides_by_n),
     ["wrong tpot mean", "len(token_times) - 1"]),
    ("latency: nearest rank", lambda: latency.check(W.latency_nearest_rank_p99),
     ["wrong ttft p99", "interpolate linearly"]),
    ("latency: ttft from scheduling", lambda: latency.check(W.latency_ttft_from_scheduling),
     ["wrong ttft", "from arrival"]),
    ("latency: single-token tpot 0",
     lambda: latency.check(W.latency_tpot_zero_for_single_token),
     ["wrong tpot", "leave out single-token requests"]),
    ("int8: /128", lambda: quantization.check_int8(W.int8_scale_128, S.dequantize_int8),
     ["wrong scale for row", "127"]),
    ("int8: per tensor", lambda: quantization.check_int8(W.int8_per_tensor, S.dequantize_int8),
     ["wrong scale", "per row"]),
    ("int8: truncation", lambda: quantization.check_int8(W.int8_truncates, S.dequantize_int8),
     ["wrong code at", "round to nearest"]),
    ("int4: range without 0",
     lambda: quantization.check_int4(W.int4_range_without_zero, S.dequantize_int4_groupwise),
     ["wrong scale for row", "range must include 0"]),
    ("int4: no clamp",
     lambda: quantization.check_int4(W.int4_no_clamp, S.dequantize_int4_groupwise),
     ["wrong code at", "clamp(round(w / scale) + zero, 0, 15)"]),
    ("int4: dequant wrong group",
     lambda: quantization.check_int4(S.quantize_int4_groupwise, W.dequantize_int4_wrong_group),
     ["dequantize_int4_groupwise is wrong", "first difference at index"]),
    ("nf4: floor", lambda: quantization.check_nf4(W.nf4_quantize_floor, S.nf4_dequantize),
     ["not the nearest level"]),
    ("nf4: int64 codes", lambda: quantization.check_nf4(W.nf4_codes_int64, S.nf4_dequantize),
     ["wrong dtypes", "codes torch.int64", "torch.uint8"]),
    ("nf4: wrong block", lambda: quantization.check_nf4(S.nf4_quantize,
                                                        W.nf4_dequantize_wrong_block),
     ["wrong lookup", "first difference at index", "i // blocksize"]),
    ("spec: deterministic accept", lambda: speculative.check_accept(W.accept_if_p_greater),
     ["never accepted", "u < p[x] / q[x]"]),
    ("spec: resample p", lambda: speculative.check_accept(W.resample_from_p),
     ["do not follow p", "chi-square", "max(0, p - q)"]),
    ("spec: resample q", lambda: speculative.check_accept(W.resample_from_q),
     ["do not follow p", "max(0, p - q)"]),
    ("spec: top token without coin flip",
     lambda: speculative.check_accept(W.accept_top_token_without_coin),
     ["draft more confident than the target on the same token", "always accepted",
      "most likely token", "min(1, p/q)"]),
    ("spec: inverted ratio", lambda: speculative.check_accept(W.accept_inverted_ratio),
     ["always accepted", "u < p[x] / q[x]"]),
    ("spec: global RNG", lambda: speculative.check_accept(W.accept_global_rng),
     ["same seed differ", "from `generator`"]),
    ("speedup: exponent", lambda: speculative.check_speedup(W.tokens_per_step_exponent_gamma,
                                                            S.expected_speedup),
     ["exponent is gamma + 1", "expected: 1.3"]),
    ("speedup: alpha 1", lambda: speculative.check_speedup(W.tokens_per_step_no_alpha_one,
                                                           S.expected_speedup),
     ["alpha = 1", "actual:   nan"]),
    ("speedup: no target cost", lambda: speculative.check_speedup(S.expected_tokens_per_step,
                                                                  W.speedup_forgets_target),
     ["wrong expected speed-up", "gamma * c + 1"]),
]


# which exercise each negative control's name prefix belongs to
EXERCISE_OF = {"kv": "kv_cache_bytes", "alloc": "block_allocator", "hash": "block_hashes",
               "lookup": "longest_cached_prefix", "sched": "schedule_step",
               "latency": "latency_metrics", "int8": "int8_per_channel", "int4": "int4_groupwise",
               "nf4": "nf4_lookup", "spec": "spec_accept", "speedup": "spec_speedup"}


def test_every_exercise_has_negative_controls():
    """A plausible wrong answer for every exercise (the Triton ones in test_triton_exercises,
    serving's and compression's in their own files, which drive real servers / training)."""
    from pathlib import Path

    from labkit.exercises.progress import EXERCISES

    elsewhere = {"triton_vector_add": "test_triton_exercises.py",
                 "triton_paged_attention": "test_triton_exercises.py",
                 "token_bucket": "test_serving_exercise.py",
                 "disconnect_abort": "test_serving_exercise.py",
                 "distillation_loss": "test_compression_exercise.py",
                 "mask_2_4": "test_compression_exercise.py",
                 "gguf_q8_0": "test_gguf_blocks.py",
                 "gguf_q4_0": "test_gguf_blocks.py",
                 "tp_shard_attention": "test_tp_attention_exercise.py",
                 "tp_attention_forward": "test_tp_attention_exercise.py",
                 "prefix_affinity": "test_prefix_affinity_exercise.py",
                 "moe_routing": "test_moe_routing_exercise.py",
                 "lora_delta": "test_lora_batching_exercise.py",
                 "lora_slots": "test_lora_batching_exercise.py",
                 "kv_connector": "test_kv_connector_exercise.py",
                 "mla_window": "test_mla_window_exercise.py"}
    here = Path(__file__).parent
    for exercise, f in elsewhere.items():
        text = (here / f).read_text()
        assert exercise in text or exercise.split("_")[0] in text, (exercise, f)
    covered = {EXERCISE_OF[name.split(":")[0]] for name, _, _ in WRONG}
    assert covered | set(elsewhere) == set(EXERCISES)


@pytest.mark.parametrize("name,run,needles", WRONG, ids=[w[0] for w in WRONG])
def test_wrong_solution_caught(name, run, needles):
    result = run()
    assert result.exercise == EXERCISE_OF[name.split(":")[0]]
    assert not result.passed
    assert result.message.startswith("✗"), result.message
    for needle in needles:
        assert needle in result.message, f"{needle!r} not in:\n{result.message}"


def test_not_implemented_is_reported_kindly():
    def kv_cache_bytes(*args, **kwargs):
        raise NotImplementedError

    result = kv_size.check(kv_cache_bytes)
    assert not result.passed and "not implemented yet" in result.message


def test_learner_crash_names_the_input():
    def kv_cache_bytes(num_layers, num_attention_heads, num_kv_heads, head_dim, seq_len,
                       batch_size, dtype):
        return 2 * num_layers * num_kv_heads * head_dim * seq_len * batch_size * dtype.itemsize_x

    result = kv_size.check(kv_cache_bytes)
    assert "raised AttributeError" in result.message
    assert "kv_cache_bytes(num_layers=32" in result.message


def test_strict_mode_raises(monkeypatch):
    monkeypatch.setenv("LABKIT_STRICT_CHECKS", "1")
    with pytest.raises(AssertionError, match="num_kv_heads"):
        kv_size.check(W.kv_bytes_uses_query_heads)


def test_allocator_checker_uses_many_copy_on_writes():
    """The random operation sequences must actually exercise fork + copy-on-write and OOM."""
    result = allocator.check(S.BlockAllocator)
    n_cow = int(result.message.split("(")[1].split(" copy-on-writes")[0])
    assert n_cow >= 20


def test_allocator_drives_the_real_model():
    from labkit.exercises import allocator_engine

    ok = allocator_engine.check_on_model(S.BlockAllocator)
    assert ok.passed, ok.message
    cow = allocator_engine.check_on_model(W.AllocatorNoCopyOnWrite)
    assert "drifted from the reference" in cow.message and "copy-on-write" in cow.message
    leak = allocator_engine.check_on_model(W.AllocatorNoRefDecrement)
    assert "blocks leaked" in leak.message
    short = allocator_engine.check_on_model(W.AllocatorOffByOne)
    assert "cannot hold its 6 tokens" in short.message


def test_scheduler_drives_the_real_model():
    from labkit.exercises import scheduler_engine

    ok = scheduler_engine.check_on_model(S.schedule_step)
    assert ok.passed and "every token equals reference generation" in ok.message, ok.message
    unchunked = scheduler_engine.check_on_model(W.schedule_no_chunking)  # the 40-token prompt
    assert "would hang" in unchunked.message and "chunked prefill" in unchunked.message
    over = scheduler_engine.check_on_model(lambda r, w, b, s: S.schedule_step(r, w, b + 4, s))
    assert "exceeds token_budget" in over.message
    too_many = scheduler_engine.check_on_model(W.schedule_max_seqs_off_by_one)
    assert "more sequences than max_num_seqs" in too_many.message
    stalled = scheduler_engine.check_on_model(lambda r, w, b, s: {})
    assert "the engine would hang" in stalled.message

    def recompute_prompt(running, waiting, budget, max_seqs):  # ignores num_computed_tokens
        plan = S.schedule_step(running, waiting, budget, max_seqs)
        return {k: (v if v == 1 else min(budget, 40)) for k, v in plan.items()}

    assert "cannot compute" in scheduler_engine.check_on_model(recompute_prompt).message


def test_latency_reference_equals_labkit_metrics_on_engine_run():
    from labkit.engine.metrics import compute_metrics

    timings = latency.engine_timings(num_requests=5, seed=3)
    ours, theirs = S.latency_metrics(timings), compute_metrics(timings)
    for metric in ("ttft", "tpot", "e2e"):
        for stat in ("mean", "p50", "p99"):
            assert ours[metric][stat] == pytest.approx(theirs[metric][stat], rel=1e-9)
    assert "real engine run" in latency.check(S.latency_metrics).message


@pytest.mark.parametrize("seed,budget,max_seqs", [(0, 16, 4), (1, 8, 3), (2, 64, 8), (3, 5, 2)])
def test_schedule_reference_equals_labkit_scheduler(seed, budget, max_seqs):
    """The exercise's contract is labkit's real scheduler (no preemption): replay engine runs."""
    states = scheduler_step.engine_states(seed, budget, max_seqs)
    assert len(states) > 5
    for running, waiting, plan in states:
        ours = S.schedule_step(running, waiting, budget, max_seqs)
        assert ours == plan and list(ours) == list(plan)


def test_prefix_functions_predict_the_engine_cache():
    ok = prefix_cache.check_on_engine(S.block_hashes, S.longest_cached_prefix)
    assert ok.passed, ok.message
    salt = prefix_cache.check_on_engine(W.hashes_ignore_salt, S.longest_cached_prefix)
    assert "differs from the engine's prefix cache" in salt.message
    rows = prefix_cache.engine_prefix_hits()
    assert sum(r["cached_tokens"] for r in rows) > 0 and any(r["salt"] for r in rows)


def test_quantizers_run_the_model():
    from labkit.exercises import quant_model

    assert quant_model.check_int8_on_model(S.quantize_int8_per_channel, S.dequantize_int8).passed
    bad = quant_model.check_int8_on_model(W.int8_per_tensor, S.dequantize_int8)
    assert "drifts further from fp32 than labkit's" in bad.message
    assert quant_model.check_int4_on_model(S.quantize_int4_groupwise,
                                           S.dequantize_int4_groupwise).passed
    bad4 = quant_model.check_int4_on_model(S.quantize_int4_groupwise,
                                           W.dequantize_int4_wrong_group)
    assert not bad4.passed


def test_acceptance_rule_on_the_shipped_model_pair():
    p, q = speculative.model_pair_distributions()
    assert ((p > 0) != (q > 0)).any()  # supports differ: the residual matters
    assert speculative.check_accept_on_models(S.accept_or_resample).passed
    assert "do not follow p" in speculative.check_accept_on_models(W.resample_from_p).message


def test_allocator_raising_the_wrong_error_on_oom_gets_a_hint():
    class WrongError(S.BlockAllocator):
        def allocate(self, seq_id, num_tokens):
            if -(-num_tokens // self.block_size) > len(self.free_list):
                raise ValueError("out of blocks")
            return super().allocate(seq_id, num_tokens)

    msg = allocator.check(WrongError).message
    assert "raised ValueError" in msg and "raise MemoryError" in msg


@pytest.mark.slow
def test_labkit_rejection_sampler_passes_the_acceptance_checker():
    """The checker's notion of right is labkit's own sampler (labkit.spec.rejection): wrapped
    to the exercise's signature, it passes every case, peaked ones included."""
    from labkit.spec.rejection import rejection_sample

    def accept_or_resample(p, q, draft_token, generator):
        emitted, k = rejection_sample([draft_token], q[None], torch.stack([p, p]), generator)
        return k == 1, emitted[0]

    result = speculative.check_accept(accept_or_resample)
    assert result.passed, result.message
    assert "peaked target, draft peaked on another token" in result.message

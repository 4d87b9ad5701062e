"""The parallel-plan calculator against hand-computed numbers and the lessons it must teach."""

from __future__ import annotations

import math

import pytest

from labkit.sim.parallel import (
    LINKS,
    bubble_fraction,
    compare,
    kv_heads_per_gpu,
    plan,
    ring_allreduce_s,
)
from labkit.sim.presets import get_model_preset


def test_ring_allreduce_by_hand():
    # 8 GPUs, 1 MiB over NVLink 4: 2*7/8 * 2**20 / 450e9 + 14 hops * 1 us
    want = 2 * 7 / 8 * 2**20 / 450e9 + 14 * 1e-6
    assert ring_allreduce_s(2**20, 8, "nvlink4") == pytest.approx(want, rel=1e-12)
    assert ring_allreduce_s(2**20, 1, "nvlink4") == 0.0
    # PCIe costs ~7x NVLink's bandwidth term for a large message: why TP stays in a node
    big = 256 * 2**20
    assert ring_allreduce_s(big, 8, "pcie5") / ring_allreduce_s(big, 8, "nvlink4") > 6
    with pytest.raises(ValueError):
        ring_allreduce_s(1, 0, LINKS["pcie4"])


def test_bubble_by_hand():
    assert bubble_fraction(4, 1) == pytest.approx(3 / 4)
    assert bubble_fraction(4, 12) == pytest.approx(3 / 15)
    assert bubble_fraction(1, 5) == 0.0


def test_kv_heads_stop_splitting_at_the_kv_head_count():
    m = get_model_preset("llama-3-8b")  # 8 KV heads
    assert [kv_heads_per_gpu(m, t) for t in (1, 2, 4, 8, 16, 32)] == [8, 4, 2, 1, 1, 1]
    p8, p16 = plan(m, "h100", tp=8), plan(m, "h100", tp=16, link="nvlink4")
    assert p8.kv_per_token_per_gpu == p16.kv_per_token_per_gpu == 2 * 32 * 1 * 128 * 2


def test_70b_plans():
    m = get_model_preset("llama-2-70b")
    one = plan(m, "h100")
    assert not one.fits and one.tokens_per_s == 0.0  # 138 GB of bf16 weights > 80 GB
    tp4, tp8, tp4pp2, pp8 = compare("llama-2-70b", "h100", [(4, 1), (8, 1), (4, 2), (1, 8)],
                                    batch=64, context=2048)
    assert tp8.weights_per_gpu == pytest.approx(m.weight_bytes / 8)
    assert tp4pp2.weights_per_gpu == tp8.weights_per_gpu
    # 8 KV heads: TP8 holds one per GPU; TP4 x PP2 holds 2 heads of half the layers: same bytes
    assert tp4pp2.kv_per_token_per_gpu == tp8.kv_per_token_per_gpu == 2 * 80 * 1 * 128 * 2
    # TP cuts per-token latency; at the same batch, memory-bound decode gains nothing from PP
    assert tp8.tpot_s < tp4.tpot_s < pp8.tpot_s
    assert tp8.tokens_per_s > tp4pp2.tokens_per_s > pp8.tokens_per_s > 0
    assert tp8.ttft_s < tp4.ttft_s
    free = 80 * 2**30 * 0.9 - m.weight_bytes / 8
    assert math.isclose(tp8.max_kv_tokens, free // (2 * 80 * 256), rel_tol=0, abs_tol=1)


def test_bad_layouts_are_named():
    with pytest.raises(ValueError, match="do not divide"):
        plan("llama-2-7b", "a100", tp=3)
    with pytest.raises(ValueError, match=">= 1"):
        plan("llama-2-7b", "a100", tp=0)


def test_70b_on_four_gpus_tp_pp_and_both():
    m = get_model_preset("llama-2-70b")
    tp4, both, pp4 = compare("llama-2-70b", "h100", [(4, 1), (2, 2), (1, 4)], batch=64,
                             context=2048)
    for p in (tp4, both, pp4):  # the same 4 GPUs hold the same bytes, however they are split
        assert p.gpus == 4 and p.weights_per_gpu == pytest.approx(m.weight_bytes / 4)
        # TP4: 2 KV heads x 80 layers; TP2xPP2: 4 x 40; PP4: 8 x 20
        assert p.kv_per_token_per_gpu == 2 * 160 * 128 * 2 and p.max_batch == tp4.max_batch
    assert tp4.tpot_s < both.tpot_s < pp4.tpot_s and tp4.ttft_s < both.ttft_s < pp4.ttft_s
    assert tp4.tokens_per_s > both.tokens_per_s > pp4.tokens_per_s > 0
    tp8 = plan(m, "h100", tp=8, batch=64, context=2048)
    assert tp8.max_batch > 2 * tp4.max_batch  # half the weights per GPU frees more than half


def test_pipeline_microbatches_and_slow_links():
    starved, full = (plan("llama-2-70b", "h100", 1, 4, microbatches=k) for k in (1, 4))
    assert starved.idle == 0.75 and full.idle == 0.0
    assert full.tokens_per_s > starved.tokens_per_s
    # across two nodes over InfiniBand: TP=16 puts every all-reduce on the slow link
    tp16 = plan("llama-2-70b", "h100", 16, 1, link="ib-ndr")
    tp8pp2 = plan("llama-2-70b", "h100", 8, 2, link="nvlink4", pp_link="ib-ndr")
    assert tp8pp2.tpot_s < tp16.tpot_s / 2 and tp16.allreduce_s > 10 * tp8pp2.allreduce_s

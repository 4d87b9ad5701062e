"""The expert-parallel plan against hand-computed numbers, the engine's counted all-to-all bytes,
and the lessons it must teach (a second node costs the NIC's ratio on the cross-node share; EPLB
lowers max/mean on a skewed load and never raises it)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from labkit.parallel.comm import TPGroup
from labkit.parallel.expert import ExpertParallelMoE
from labkit.parallel.plan import make_plan
from labkit.paths import REPO_ROOT
from labkit.sim.expert import (
    all_to_all_bytes,
    all_to_all_s,
    contiguous_rank_load,
    ep_plan,
    ep_table,
    eplb,
    imbalance,
    sample_expert_load,
)
from labkit.sim.presets import get_model_preset

GiB = 2**30
NVLINK, NIC = 450e9, 50e9  # bytes/s each way per GPU (the docstring's sources)


def test_all_to_all_bytes_by_hand():
    # Mixtral decode of 64 sequences in bf16: 64 tokens x top-2 x 4096 x 2 bytes
    assert all_to_all_bytes(64, 2, 4096, 2) == 1_048_576
    with pytest.raises(ValueError):
        all_to_all_bytes(-1, 2, 4096, 2)


def test_engine_counts_the_same_bytes():
    """The engine's real dispatch (one rank, no process group) counts what the formula says."""
    from labkit.model.testing import tiny_config

    torch.manual_seed(0)
    cfg = tiny_config(architecture="Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, qk_norm=True)
    ep = ExpertParallelMoE(cfg, 0, make_plan(cfg, 1, 0, True), TPGroup())
    with torch.no_grad():
        ep(torch.randn(11, cfg.hidden_size))
    log = ep.group.log.reset()
    want = all_to_all_bytes(11, 2, cfg.hidden_size, 4)
    assert log["all_to_all_dispatch"]["bytes"] == log["all_to_all_combine"]["bytes"] == want


def test_committed_bench_bytes_equal_the_formula():
    """datasets/results/moe.json (EP=1 and EP=2 over real gloo processes) against the formula
    on labkit-tiny-moe's shipped config: bytes per step x steps = MoE layers x the formula of
    all the steps' tokens (the formula is linear in tokens)."""
    bench = json.loads((REPO_ROOT / "datasets/results/moe.json").read_text())
    run = next(r for r in bench["results"] if r["checkpoint"] == "labkit-tiny-moe")
    cfg = json.loads((REPO_ROOT / "datasets/models/labkit-tiny-moe/config.json").read_text())
    layers, k, h = cfg["num_hidden_layers"], cfg["num_experts_per_tok"], cfg["hidden_size"]
    for ep in run["ep"]:
        tokens = round(ep["tokens_per_step"] * ep["steps"])
        for kind in ("dispatch_bytes_per_step", "combine_bytes_per_step"):
            assert round(ep[kind] * ep["steps"]) == layers * all_to_all_bytes(tokens, k, h, 4)
    assert run["ep"][0]["remote_bytes_per_step"] == 0 < run["ep"][1]["remote_bytes_per_step"]


def test_all_to_all_time_by_hand():
    b = 64e6  # bytes arriving at one rank
    assert all_to_all_s(b, 1, 8) == 0.0
    assert all_to_all_s(b, 8, 8) == pytest.approx(b * 7 / 8 / NVLINK + 1e-6, rel=1e-12)
    two = all_to_all_s(b, 16, 8)  # half of it crosses the NIC: that term wins
    assert two == pytest.approx(max(b * 7 / 16 / NVLINK, b * 8 / 16 / NIC) + 5e-6, rel=1e-12)


def test_deepseek_v3_on_one_node_vs_two():
    """The seeds' question. Same step (4096 tokens), 8 x H200 vs 2 nodes x 8."""
    m = get_model_preset("deepseek-v3")
    one, two = (ep_plan("deepseek-v3", "h200", n, tokens=4096) for n in (8, 16))
    dispatch = 4096 * 8 * 7168 * 2
    assert one.dispatch_bytes == two.dispatch_bytes == dispatch
    assert (one.cross_node_share, two.cross_node_share) == (0.0, 0.5)
    # balanced: each rank receives T*k/N rows of hidden*2 bytes; 58 MoE layers, there and back
    recv8, recv16 = dispatch / 8, dispatch / 16
    assert one.all_to_all_s == pytest.approx(58 * 2 * (recv8 * 7 / 8 / NVLINK + 1e-6), rel=1e-9)
    assert two.all_to_all_s == pytest.approx(58 * 2 * (recv16 * 8 / 16 / NIC + 5e-6), rel=1e-9)
    # the ratio is the link ratio on the cross-node share, however many bytes a rank gets
    bw_ratio = (recv16 * 0.5 / NIC) / (recv8 * 7 / 8 / NVLINK)
    assert bw_ratio == pytest.approx(NVLINK / NIC * 0.5 / 2 / (7 / 8))
    assert two.all_to_all_s / one.all_to_all_s == pytest.approx(bw_ratio, rel=0.02)
    assert two.all_to_all_s > 2 * one.all_to_all_s
    # EP moves less than TP's all-reduces of the same model (k/N of the tokens per rank)
    assert one.all_to_all_s < one.tp_allreduce_s and two.all_to_all_s < two.tp_allreduce_s
    # memory: FP8 weights fit 8 x 141 GiB with attention replicated (DP)
    dense = m.num_params - 58 * 256 * 3 * 7168 * 2048
    assert one.weights_per_gpu == pytest.approx(dense + (m.num_params - dense) / 8, rel=1e-12)
    assert one.fits and "< 126.9 GiB" in one.why
    assert one.max_kv_tokens == int(8 * (141 * GiB * 0.9 - one.weights_per_gpu) // 70_272)


def test_bf16_deepseek_does_not_fit_one_node():
    bf16 = dataclasses.replace(get_model_preset("deepseek-v3"), dtype_bytes=2)
    p = ep_plan(bf16, "h200", 8)
    assert not p.fits and p.max_kv_tokens == 0 and ">= 126.9 GiB" in p.why
    assert ep_plan(bf16, "h200", 16).fits


def test_sampled_load():
    load = sample_expert_load(256, 1000, 8, skew=1.0, seed=3)
    assert sum(load) == 8000 and max(load) <= 1000  # k distinct experts per token
    assert load == sample_expert_load(256, 1000, 8, skew=1.0, seed=3)
    flat = sample_expert_load(256, 1000, 8, skew=0.0, seed=3)
    assert imbalance(load) > 2 * imbalance(flat) > 2
    with pytest.raises(ValueError, match="top_k"):
        sample_expert_load(4, 10, 5)


def test_eplb_by_hand():
    """4 experts, 2 ranks, 2 spare slots: the hot expert gets 3 copies of 8/3 rows each; the
    best split of {8/3, 8/3, 8/3, 1, 1, 0} into two threes is 16/3 | 14/3."""
    load = [8, 1, 1, 0]
    assert contiguous_rank_load(load, 2) == [9.0, 1.0]
    p = eplb(load, 2, redundant=2)
    assert p.replicas == [3, 1, 1, 1]
    assert sorted(p.rank_load) == pytest.approx([14 / 3, 16 / 3])
    assert imbalance(p.rank_load) == pytest.approx(16 / 15)
    assert sorted(sum(p.rank_experts, [])) == [0, 0, 0, 1, 2, 3]
    with pytest.raises(ValueError, match="divide"):
        eplb(load, 2, redundant=1)


def test_eplb_lowers_skewed_and_never_raises():
    for seed in range(8):
        for skew, n in ((0.0, 8), (1.0, 8), (1.2, 16), (2.0, 4)):
            load = sample_expert_load(64, 512, 6, skew=skew, seed=seed)
            before = imbalance(contiguous_rank_load(load, n))
            for r in (0, n, 2 * n):
                assert imbalance(eplb(load, n, r).rank_load) <= before + 1e-12
    # DeepSeek-V3 across 2 nodes: the hottest expert alone outweighs a rank's share, so
    # re-placing cannot balance it; copies can
    flat, copies = (ep_plan("deepseek-v3", "h200", 16, skew=1.2, redundant=r) for r in (0, 32))
    assert copies.imbalance_eplb < flat.imbalance_eplb < flat.imbalance
    assert copies.imbalance_eplb < 1.1 and flat.imbalance_eplb > 1.3
    assert copies.moe_eplb_s < flat.moe_eplb_s < flat.moe_s
    assert flat.moe_balanced_s <= copies.moe_eplb_s
    # the price: 32 copies over 16 GPUs = 2 experts per GPU in each of the 58 MoE layers
    assert copies.eplb_extra_bytes_per_gpu == 58 * 2 * 3 * 7168 * 2048
    assert copies.weights_per_gpu - flat.weights_per_gpu == copies.eplb_extra_bytes_per_gpu
    assert copies.experts_per_gpu == 18


def test_table_and_bad_input():
    rows = ep_table(layouts=(8, 16), tokens=1024)
    assert [r["gpus"] for r in rows] == [8, 16] and [r["nodes"] for r in rows] == [1, 2]
    assert rows[1]["all_to_all_ms"] > rows[0]["all_to_all_ms"]
    with pytest.raises(ValueError, match="dense"):
        ep_plan("llama-2-7b", "h100", 8)
    with pytest.raises(ValueError, match="divide"):
        ep_plan("mixtral", "h100", 3)
    with pytest.raises(ValueError, match="experts"):
        ep_plan("mixtral", "h100", 2, load=[1, 2, 3])


def test_readme_quotes_the_simulators_answer():
    """The README's EP paragraph states what ep_table / ep_plan compute (rerun on a change)."""
    text = " ".join((REPO_ROOT / "README.md").read_text(encoding="utf-8").split())
    one, two = ep_table("deepseek-v3", "h200", layouts=(8, 16), tokens=4096)
    copies = ep_plan("deepseek-v3", "h200", 16, redundant=32)
    for quoted in (f"{one['weights_GiB_per_gpu']:.0f} GiB of weights per GPU of 141",
                   f"{one['all_to_all_ms']:.1f} ms on one node and {two['all_to_all_ms']:.1f} ms",
                   f"({two['all_to_all_ms'] / one['all_to_all_ms']:.1f}×",
                   f"({one['tp_allreduce_ms']:.1f} and {two['tp_allreduce_ms']:.0f} ms)",
                   f"max/mean {two['imbalance']:.1f};", f"gets {two['imbalance_eplb']:.2f}",
                   f"32 copies get {copies.imbalance_eplb:.1f} for "
                   f"{copies.eplb_extra_bytes_per_gpu / GiB:.1f} GiB",
                   f"from {two['moe_ms']:.0f} to {1e3 * copies.moe_eplb_s:.0f} ms"):
        assert quoted in text, quoted

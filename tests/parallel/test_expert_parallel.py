"""Expert parallelism (``LLM(..., tensor_parallel_size=2, enable_expert_parallel=True)``) on
the three MoE architectures: greedy output equals transformers' token for token, the
all-to-all bytes of every step equal tokens x top-k x hidden x 4 in each direction, each rank
loads only its own experts, bad combinations are refused by name, a killed rank fails cleanly.

One engine per architecture (two worker processes each) is shared by the module's tests."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from labkit import LLM, SamplingParams
from labkit.engine.invariants import assert_no_leaks
from labkit.errors import MoEUnsupportedError
from labkit.model.loader import load_config, load_pretrained
from labkit.model.moe import moe_blocks
from labkit.model.testing import tiny_config, tiny_moe_checkpoint
from labkit.parallel.comm import TPGroup
from labkit.parallel.expert import ExpertParallelMoE, token_split
from labkit.parallel.plan import TensorParallelError, make_plan
from labkit.parallel.shard import SafetensorsSource, StateDictSource, build_shard
from labkit.parallel.workers import WorkerError

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

ARCHS = ["mixtral", "qwen3_moe", "qwen2_moe"]
MAX_NEW = 6


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ep")
    return {a: tiny_moe_checkpoint(root / a, a, seed=20 + i) for i, a in enumerate(ARCHS)}


@pytest.fixture(scope="module")
def prompts():
    """Lengths 1..23 (an odd total: the ranks' token shares differ), two sharing a prefix."""
    g = torch.Generator().manual_seed(5)
    r = lambda n: torch.randint(0, 256, (n,), generator=g).tolist()  # noqa: E731
    shared = r(8)
    return [r(5), shared + r(3), r(1), r(23), shared + r(6)]


@pytest.fixture(scope="module")
def runs(ckpts, prompts):
    """{arch: (llm, outputs, transformers' greedy continuations)}; shut down at the end."""
    out = {}
    sp = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    for arch, (hf, path) in ckpts.items():
        with torch.no_grad():
            ref = [hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p)),
                               max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]
        # block 4 and a 16-token budget: prefix hits and chunked prefill on the ranks too
        llm = LLM(model=str(path), dtype=torch.float32, device="cpu", block_size=4,
                  max_num_batched_tokens=16, tensor_parallel_size=2,
                  enable_expert_parallel=True)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=sp)
        out[arch] = (llm, [o.outputs[0].token_ids for o in outs], ref)
    yield out
    for llm, _, _ in out.values():
        llm.shutdown()


@pytest.mark.parametrize("arch", ARCHS)
def test_ep2_greedy_equals_transformers(runs, arch):
    llm, got, ref = runs[arch]
    assert got == ref
    assert_no_leaks(llm.llm_engine)
    assert llm.llm_engine.stats()["prefix_hit_tokens"] > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_all_to_all_bytes_equal_the_formula(runs, arch):
    llm, _, _ = runs[arch]
    c = llm.model.config  # the CheckpointHandle the ranks read from
    moe, k, h, E = len(c.moe_layers), c.num_experts_per_tok, c.hidden_size, c.num_experts
    dense = c.num_hidden_layers - moe
    steps = [s for s in llm.llm_engine.trace.steps if s["scheduled"]]
    assert steps
    remote = 0
    for s in steps:
        col, T = s["collectives"], s["num_batched_tokens"]
        for kind in ("all_to_all_dispatch", "all_to_all_combine"):
            assert col[kind]["count"] == moe
            assert col[kind]["bytes"] == moe * T * k * h * 4  # float32, summed over the ranks
            assert 0 <= col[kind]["remote_bytes"] <= col[kind]["bytes"]
        assert col["all_to_all_dispatch"]["remote_bytes"] == col["all_to_all_combine"][
            "remote_bytes"]  # every row that left comes back
        remote += col["all_to_all_dispatch"]["remote_bytes"]
        assert col["all_to_all_counts"]["bytes"] == moe * 2 * E * 8  # E int64 from each rank
        assert col["all_gather_tokens"]["bytes"] == moe * max(token_split(T, 2)) * h * 4
        # attention in every layer, the dense MLPs, the embedding: the MoE MLPs all-reduce none
        assert col["all_reduce"]["count"] == c.num_hidden_layers + dense + 1
    assert remote > 0, "no pair ever crossed to the other rank"


def test_each_rank_loads_only_its_experts(ckpts):
    """Rank 1 of 2 holds experts E/2..E-1 of the checkpoint, read from disk (its own tensors
    only) or cut from an in-memory model's stacked state; its MoE layers keep the whole router."""
    _, path = ckpts["mixtral"]
    whole, _ = load_pretrained(path, skip_tokenizer_init=True)
    c = whole.config
    plan = make_plan(c, 2, 1, expert_parallel=True)
    read: list[str] = []

    class Recording(SafetensorsSource):
        def read(self, name, part):
            read.append(name)
            return super().read(name, part)

    state = {k: v.clone() for k, v in whole.state_dict().items()}
    for source in (Recording(path), StateDictSource(state)):
        shard = build_shard(c, plan, source, TPGroup())
        for full, mine in zip(moe_blocks(whole), moe_blocks(shard)):
            assert isinstance(mine, ExpertParallelMoE) and mine.first_expert == 2
            assert torch.equal(mine.experts.gate_up_proj, full.experts.gate_up_proj[2:])
            assert torch.equal(mine.experts.down_proj, full.experts.down_proj[2:])
            assert torch.equal(mine.gate.weight, full.gate.weight)
    assert any(".experts.3." in n for n in read)
    assert not any(".experts.0." in n or ".experts.1." in n for n in read)


def test_one_rank_equals_the_layer():
    """World 1 (no process group): dispatch and combine to itself give the layer's output."""
    torch.manual_seed(0)
    cfg = tiny_config(architecture="Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                      moe_intermediate_size=32, shared_expert_intermediate_size=16)
    from labkit.model.moe import SparseMoeBlock

    ref = SparseMoeBlock(cfg, 0).eval()
    torch.nn.init.normal_(ref.gate.weight, std=0.5)
    ep = ExpertParallelMoE(cfg, 0, make_plan(cfg, 1, 0, True), TPGroup())
    ep.load_state_dict(ref.state_dict())
    x = torch.randn(7, cfg.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(ep(x), ref(x), rtol=1e-5, atol=1e-6)
    log = ep.group.log.reset()
    assert log["all_to_all_dispatch"] == {"count": 1, "bytes": 7 * 2 * 64 * 4,
                                          "remote_bytes": 0}


def test_bad_combinations_are_refused_by_name(ckpts):
    mixtral = load_config(ckpts["mixtral"][1])  # 4 experts, 4 heads, 2 KV heads
    six = dataclasses.replace(mixtral, num_experts=6)
    with pytest.raises(TensorParallelError, match="num_experts 6 is not divisible by "
                       "tensor_parallel_size 4"):
        make_plan(six, 4, 0, expert_parallel=True)
    with pytest.raises(MoEUnsupportedError, match="enable_expert_parallel"):
        make_plan(mixtral, 2, 0)
    with pytest.raises(TensorParallelError, match="has no MoE layers"):
        make_plan(tiny_config(), 2, 0, expert_parallel=True)
    with pytest.raises(TensorParallelError, match="num_experts 4 is not divisible"):  # no spawn
        LLM(model=str(ckpts["mixtral"][1]), tensor_parallel_size=3, enable_expert_parallel=True)


def test_cli_flag_reaches_the_plan(ckpts, capsys):
    """`labkit generate --tp 3 --enable-expert-parallel` reaches make_plan (refused before any
    worker starts: 4 experts do not split 3 ways); `labkit serve` passes the flag to the engine
    settings only when given."""
    from labkit.cli import main

    with pytest.raises(SystemExit) as bad:
        main(["generate", "--model", str(ckpts["mixtral"][1]), "--tp", "3",
              "--enable-expert-parallel", "t1 t2"])
    assert bad.value.code == 2
    assert "num_experts 4 is not divisible by tensor_parallel_size 3" in capsys.readouterr().err
    from labkit.serve.launcher import ENGINE_FLAGS, build_parser

    for argv, want in ((["m", "--tp", "2", "--enable-expert-parallel"], True), (["m"], None)):
        args = build_parser().parse_args(argv)
        assert {k: getattr(args, k) for k in ENGINE_FLAGS}["enable_expert_parallel"] is want


def test_a_killed_rank_fails_cleanly(runs, prompts):
    """Last: it ends the shared qwen3_moe engine. A rank dies between steps; the step raises
    WorkerError, the request is aborted and freed, no worker survives."""
    llm = runs["qwen3_moe"][0]
    eng = llm.llm_engine
    workers = eng.executor.runner.workers
    eng.add_request("k", prompts[3], SamplingParams(temperature=0, max_tokens=20))
    eng.step()
    workers._procs[1].kill()
    with pytest.raises(Exception) as info:
        while eng.has_unfinished_requests():
            eng.step()
    assert isinstance(info.value, WorkerError) or isinstance(info.value.__cause__, WorkerError)
    assert not eng.has_unfinished_requests()
    assert_no_leaks(eng)
    assert not any(p.is_alive() for p in workers._procs)

"""A model split over tensor-parallel ranks computes what the whole model computes.

The reference is the unsplit labkit model (itself tested against transformers). World size 1
runs in-process through the exact sharded code path; world size 2 runs two gloo processes.
"""

from __future__ import annotations

import pytest
import torch
from tp_fixtures import ARCHS, BASE, ManyShards

from labkit.model.config import ModelConfig
from labkit.model.generate import generate
from labkit.parallel.comm import TPGroup
from labkit.parallel.plan import TensorParallelError, make_plan, shard_config
from labkit.parallel.shard import SafetensorsSource, StateDictSource, build_shard, slice_spec
from labkit.parallel.workers import WorkerGroup


def test_plan_slices_by_hand():
    cfg = ModelConfig(**BASE)  # 4 q heads, 2 kv heads, head_dim 16, mlp 96, vocab 101
    p1 = make_plan(cfg, 2, 1)
    assert p1.q_rows == (32, 64) and p1.kv_rows == (16, 32) and p1.mlp_rows == (48, 96)
    assert p1.vocab_per_rank == 51 and p1.vocab_rows == (51, 101)  # last shard is short
    assert slice_spec("model.layers.0.self_attn.o_proj.weight", p1) == (1, (32, 64))
    assert slice_spec("model.layers.1.mlp.down_proj.weight", p1) == (1, (48, 96))
    assert slice_spec("model.norm.weight", p1) is None
    local = shard_config(cfg, p1)
    assert (local.num_attention_heads, local.num_key_value_heads,
            local.intermediate_size) == (2, 1, 48)


def test_plan_replicates_kv_heads_when_fewer_than_ranks():
    cfg = ModelConfig(**dict(BASE, num_key_value_heads=1))
    plans = [make_plan(cfg, 4, r) for r in range(4)]
    assert all(p.num_kv_heads == 1 and p.kv_head_start == 0 and p.kv_replicated for p in plans)
    cfg2 = ModelConfig(**dict(BASE, num_attention_heads=8, num_key_value_heads=2, head_dim=8))
    assert [make_plan(cfg2, 4, r).kv_head_start for r in range(4)] == [0, 0, 1, 1]


@pytest.mark.parametrize("kw, world, what", [
    (dict(num_attention_heads=4), 3, "num_attention_heads 4"),
    (dict(intermediate_size=90), 4, "intermediate_size 90"),
    (dict(num_attention_heads=12, num_key_value_heads=6, head_dim=8), 4,
     "num_key_value_heads 6"),
    (dict(num_attention_heads=6, num_key_value_heads=3, head_dim=8, intermediate_size=96), 6,
     None),
])
def test_plan_rejects_what_does_not_divide(kw, world, what):
    cfg = ModelConfig(**dict(BASE, **kw))
    if what is None:  # 6 ranks over 3 KV heads: each KV head copied to 2 ranks
        assert make_plan(cfg, world, 5).kv_head_start == 2
        return
    with pytest.raises(TensorParallelError, match=what):
        make_plan(cfg, world, 0)


@pytest.mark.parametrize("name", list(ARCHS))
def test_world_size_one_is_the_same_model(checkpoints, name):
    folder, model = checkpoints[name]
    group = TPGroup()
    shard = build_shard(model.config, make_plan(model.config, 1, 0),
                        SafetensorsSource(folder), group)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=g)
    with torch.inference_mode():
        assert torch.equal(shard(ids), model(ids))
    L, h = model.config.num_hidden_layers, model.config.hidden_size
    sites = [site for site, _, _ in group.log.calls]
    assert sites == ["embedding"] + [f"layer {i} {part}" for i in range(L)
                                     for part in ("attention", "mlp")] + ["lm_head"]
    log = group.log.reset()
    assert log["all_reduce"] == {"count": 2 * L + 1, "bytes": (2 * L + 1) * 2 * 9 * h * 4}
    assert log["all_gather"] == {"count": 1, "bytes": 2 * 9 * 101 * 4}


def test_state_dict_source_matches_checkpoint(checkpoints):
    _, model = checkpoints["llama_gqa"]
    plan = make_plan(model.config, 2, 1)
    a = build_shard(model.config, plan, StateDictSource(model.state_dict()), TPGroup(1, 1))
    folder, _ = checkpoints["llama_gqa"]
    b = build_shard(model.config, plan, SafetensorsSource(folder), TPGroup(1, 1))
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n


@pytest.mark.slow
def test_two_ranks_match_the_whole_model(checkpoints):
    """Every architecture on 2 gloo processes (one start serves all four: see ManyShards):
    logits within float32 tolerance, greedy tokens equal, collectives as the formula says."""
    models = {n: (model.config, str(folder)) for n, (folder, model) in checkpoints.items()}
    workers = WorkerGroup(2, ManyShards(models), timeout_s=60)
    try:
        for name in ARCHS:
            _two_ranks_match(workers, name, checkpoints[name][1])
    finally:
        workers.shutdown()
    assert not any(p.is_alive() for p in workers._procs)


def _two_ranks_match(workers: WorkerGroup, name: str, model) -> None:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (2, 11), generator=g)
    prompt = torch.randint(0, model.config.vocab_size, (7,), generator=g).tolist()
    logits = workers.call("call", name, "forward", ids)
    with torch.inference_mode():
        want = model(ids)
    for got in logits:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5, msg=name)
    assert torch.equal(logits[0], logits[1]), name  # both ranks hold the same full logits
    log = workers.call("call", name, "collectives")[0]
    L, h, per = model.config.num_hidden_layers, model.config.hidden_size, 51
    assert log["all_reduce"] == {"count": 2 * L + 1, "bytes": (2 * L + 1) * 2 * 11 * h * 4}
    assert log["all_gather"] == {"count": 1, "bytes": 2 * 11 * per * 4}
    assert workers.call("call", name, "generate", prompt, 12) == [generate(model, prompt, 12)] * 2
    kv = workers.call("call", name, "kv_heads")  # split, or copied when fewer than ranks
    assert kv == [max(1, model.config.num_key_value_heads // 2)] * 2, name

class _RecordingOpen:
    """``safe_open`` that records every read: (name, "tensor" | "slice", bytes copied out)."""

    def __init__(self, log: list) -> None:
        from safetensors import safe_open

        self.real, self.log = safe_open, log

    def __call__(self, path, framework="pt"):
        real, log = self.real(path, framework=framework), self.log

        class Handle:
            def __enter__(self):
                real.__enter__()
                return self

            def __exit__(self, *exc):
                return real.__exit__(*exc)

            def keys(self):
                return real.keys()

            def get_tensor(self, name):
                t = real.get_tensor(name)
                log.append((name, "tensor", t.numel() * t.element_size()))
                return t

            def get_slice(self, name):
                sl = real.get_slice(name)

                class Slice:
                    def __getitem__(self, index):
                        t = sl[index]
                        log.append((name, "slice", t.numel() * t.element_size()))
                        return t
                return Slice()
        return Handle()


@pytest.mark.parametrize("name", ["llama_mqa", "qwen2_bias"])
def test_each_rank_reads_only_its_slices(checkpoints, name, monkeypatch):
    """Every split tensor is read with get_slice (a view of the memory-mapped file: only the
    copied range is paged in), never get_tensor; the only whole reads are the norms; the two
    ranks' slices of a tensor add up to it exactly once (a replicated KV head twice)."""
    import labkit.parallel.shard as shard_mod

    folder, model = checkpoints[name]
    full = {n: t.numel() * t.element_size() for n, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        full.pop("lm_head.weight")
    logs: list[list] = []
    for rank in range(2):
        logs.append([])
        monkeypatch.setattr(shard_mod, "safe_open", _RecordingOpen(logs[-1]))
        build_shard(model.config, make_plan(model.config, 2, rank), SafetensorsSource(folder),
                    TPGroup(rank, 1))
    whole = {n for n, how, _ in logs[0] if how == "tensor"}
    assert whole == {n for n in full if n.endswith(("norm.weight", "o_proj.bias"))}
    replicas = 2 if model.config.num_key_value_heads < 2 else 1
    tied = model.config.tie_word_embeddings
    for n, nbytes in full.items():
        if n in whole:
            continue
        got = [sum(b for m, how, b in log if m == n and how == "slice") for log in logs]
        if n in ("model.embed_tokens.weight", "lm_head.weight"):  # 101 rows: 51 + 50
            reads = 2 if tied and n == "model.embed_tokens.weight" else 1  # tied head: again
            assert got == [51 * nbytes // 101 * reads, 50 * nbytes // 101 * reads], n
        else:  # an even split; an MQA model's one KV head is each rank's whole slice
            copies = replicas if n.split(".")[-2] in ("k_proj", "v_proj") else 1
            assert got == [nbytes * copies // 2] * 2, (n, got, nbytes)


def test_backend_follows_the_device(monkeypatch):
    from labkit.config import ParallelConfig
    from labkit.errors import EngineConfigError
    from labkit.parallel.executor import distributed_backend

    assert distributed_backend("cpu", 4) == "gloo"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert distributed_backend(torch.device("cuda"), 2) == "nccl"
    with pytest.raises(TensorParallelError, match="tensor_parallel_size 4 needs 4 GPUs"):
        distributed_backend("cuda", 4)
    with pytest.raises(TensorParallelError, match="not meta"):
        distributed_backend("meta", 1)
    with pytest.raises(ValueError, match="needs torch.distributed"):
        TPGroup(0, 2, distributed=False)
    assert ParallelConfig(distributed_executor_backend="mp").uses_workers
    assert not ParallelConfig().uses_workers and ParallelConfig(tensor_parallel_size=2).uses_workers
    with pytest.raises(EngineConfigError, match="distributed_executor_backend"):
        ParallelConfig(distributed_executor_backend="ray")

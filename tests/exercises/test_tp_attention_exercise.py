"""Exercise 12 (tp_shard_attention, tp_attention_forward): the references pass, on threads and
on 2 gloo processes; plausible wrong splits and all-reduce placements are rejected with the
message that names the mistake (negative controls)."""

import itertools
import textwrap

import psutil
import pytest
import torch
import torch.nn.functional as F

from labkit.exercises import tp_attention as A
from labkit.exercises import tp_attention_solutions as S
from labkit.exercises import tp_forward as Fw
from labkit.exercises.portable import portable


# ---- wrong splits -------------------------------------------------------------------------
def _edit(fix):
    """A split that is the reference's except where ``fix`` changes it."""
    def shard(weights, num_heads, num_kv_heads, head_dim, rank, world):
        out = S.shard_attention(weights, num_heads, num_kv_heads, head_dim, rank, world)
        fix(out, weights, num_heads, num_kv_heads, head_dim, rank, world)
        return out
    return shard


def _o_by_columns(out, w, hq, hkv, d, rank, world):  # column-parallel o_proj (output rows)
    h = w["o_proj.weight"].shape[0] // world
    out["o_proj.weight"] = w["o_proj.weight"][rank * h:(rank + 1) * h]


def _kv_whole(out, w, hq, hkv, d, rank, world):
    for n in ("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias"):
        if n in w:
            out[n] = w[n]


def _q_interleaved(out, w, hq, hkv, d, rank, world):  # the view(head_dim, heads, ...) mistake
    n = hq // world
    t = w["q_proj.weight"]
    out["q_proj.weight"] = t.view(d, hq, -1)[:, rank * n:(rank + 1) * n].reshape(n * d, -1)


def _kv_modulo(out, w, hq, hkv, d, rank, world):  # replicated KV head chosen by rank % kv
    if hkv < world:
        for n in ("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias"):
            if n in w:
                out[n] = w[n][(rank % hkv) * d:(rank % hkv + 1) * d]


def _kv_not_replicated(out, w, hq, hkv, d, rank, world):  # hkv // world == 0 heads
    per = hkv // world
    for n in ("k_proj.weight", "v_proj.weight", "k_proj.bias", "v_proj.bias"):
        if n in w:
            out[n] = w[n][rank * per * d:(rank + 1) * per * d]


def _o_bias_split(out, w, hq, hkv, d, rank, world):
    if "o_proj.bias" in w:
        h = w["o_proj.bias"].shape[0] // world
        out["o_proj.bias"] = w["o_proj.bias"][rank * h:(rank + 1) * h]


def _o_bias_rank0_only(out, w, hq, hkv, d, rank, world):
    if "o_proj.bias" in w and rank:
        out["o_proj.bias"] = torch.zeros_like(w["o_proj.bias"])


def _to_double(out, w, hq, hkv, d, rank, world):
    out["q_proj.weight"] = out["q_proj.weight"].double()


WRONG_SPLITS = [
    ("o_proj split by columns", _o_by_columns, ["wrong shape of o_proj.weight", "ROW-parallel"]),
    ("kv heads not divided", _kv_whole, ["wrong shape of k_proj.weight",
                                         "KV heads are not divided"]),
    ("heads interleaved", _q_interleaved, ["wrong rows of q_proj.weight", "interleaved",
                                           "expected: 'rows heads 0..1'"]),
    ("replicated kv head by rank % kv", _kv_modulo, ["rank 1 holds the wrong rows of k_proj",
                                                     "query heads 2..3 read KV heads 0..0"]),
    ("kv heads not replicated", _kv_not_replicated, ["copy of the ONE KV head"]),
    ("o_proj bias split", _o_bias_split, ["o_proj's bias is not split"]),
    ("o_proj bias on rank 0 only", _o_bias_rank0_only, ["rank 1's o_proj.bias is not the "
                                                        "block's", "whole on every rank"]),
    ("converted dtype", _to_double, ["q_proj.weight on rank 0 changed dtype", "torch.float64"]),
]


@pytest.mark.parametrize("name,fix,needles", WRONG_SPLITS, ids=[w[0] for w in WRONG_SPLITS])
def test_wrong_split_caught(name, fix, needles):
    result = A.check_shard(_edit(fix))
    assert not result.passed and result.message.startswith("✗ tp_shard_attention")
    for needle in needles:
        assert needle in result.message, f"{needle!r} not in:\n{result.message}"


def test_reference_split_passes_and_equals_the_engine_loader():
    assert A.check_shard(S.shard_attention)
    # independent of the plan: the split ranks' partial outputs sum to the block's output
    for case in A.SHARD_CASES:
        block = A.build_block(case)
        shards = [S.shard_attention(block.weights, case.heads, case.kv_heads, case.head_dim, r,
                                    case.world) for r in range(case.world)]
        assert A._combined_error(block, shards) < 1e-5


# ---- wrong forwards -----------------------------------------------------------------------
def no_all_reduce(x, shard, attend, all_reduce):
    return S.attention_forward(x, shard, attend, lambda t: t)


def reduce_twice(x, shard, attend, all_reduce):
    return all_reduce(S.attention_forward(x, shard, attend, all_reduce))


def bias_before_reduce(x, shard, attend, all_reduce):
    q = F.linear(x, shard["q_proj.weight"], shard.get("q_proj.bias"))
    k = F.linear(x, shard["k_proj.weight"], shard.get("k_proj.bias"))
    v = F.linear(x, shard["v_proj.weight"], shard.get("v_proj.bias"))
    return all_reduce(F.linear(attend(q, k, v), shard["o_proj.weight"], shard.get("o_proj.bias")))


def reduce_after_qkv(x, shard, attend, all_reduce):  # treats q/k/v as the partial sums
    q = all_reduce(F.linear(x, shard["q_proj.weight"], shard.get("q_proj.bias")))
    k = all_reduce(F.linear(x, shard["k_proj.weight"], shard.get("k_proj.bias")))
    v = all_reduce(F.linear(x, shard["v_proj.weight"], shard.get("v_proj.bias")))
    y = F.linear(attend(q, k, v), shard["o_proj.weight"])
    return y + shard["o_proj.bias"] if "o_proj.bias" in shard else y


WRONG_FORWARDS = [
    ("all-reduce missing", no_all_reduce, ["the all-reduce is missing", "row-parallel"]),
    ("reduced twice", reduce_twice, ["the output is 2x the block's"]),
    ("bias before the all-reduce", bias_before_reduce, ["counts 2 times", "once, after"]),
    ("all-reduce after q/k/v", reduce_after_qkv, ["you all-reduced shape [6, 16]",
                                                  "mixes different heads"]),
]


@pytest.mark.parametrize("name,fn,needles", WRONG_FORWARDS, ids=[w[0] for w in WRONG_FORWARDS])
def test_wrong_forward_caught_on_threads(name, fn, needles):
    result = Fw.check_forward(fn, processes=False)
    assert not result.passed and result.message.startswith("✗ tp_attention_forward")
    assert "ranks as threads" in result.message
    for needle in needles:
        assert needle in result.message, f"{needle!r} not in:\n{result.message}"


def test_forward_with_a_wrong_split_blames_the_split():
    result = Fw.check_forward(S.attention_forward, _edit(_kv_whole), processes=False)
    assert not result.passed and "KV heads are not divided" in result.message


def test_a_crash_on_one_rank_is_named_and_the_other_does_not_hang():
    counter = itertools.count()

    def second_rank_crashes(x, shard, attend, all_reduce):
        if next(counter) == 1:  # whichever thread comes second; the first waits in all_reduce
            raise KeyError("boom")
        return S.attention_forward(x, shard, attend, all_reduce)

    result = Fw.check_forward(second_rank_crashes, processes=False)
    assert not result.passed and "raised KeyError: 'boom'" in result.message


def _notebook_function(src: str, name: str):
    """A function as a notebook defines it: its module is __main__, so pickle cannot send it."""
    g = {"__name__": "__main__", "S": S}
    exec(textwrap.dedent(src), g)
    return g[name]


def test_portable_rebuilds_a_notebook_function_and_its_helpers():
    fn = _notebook_function("""
        import math
        def helper(t):
            return t * math.sqrt(4.0)
        def f(t, k=3, *, j=0):
            return helper(t) + k + j
    """, "f")
    assert fn.__module__ == "__main__"
    p = portable(fn)
    assert set(p.functions) == {"helper"} and p.functions["helper"].modules == {"math": "math"}
    assert p.load()(torch.tensor(1.0)).item() == 5.0


@pytest.mark.slow
def test_reference_passes_on_two_gloo_processes():
    result = Fw.check_forward(S.attention_forward, S.shard_attention)
    assert result.passed, result.message
    assert "2 processes over torch.distributed (gloo)" in result.message
    assert "768 bytes" in result.message  # 6 tokens x 32 hidden x 4 bytes, one all-reduce


@pytest.mark.slow
def test_gloo_run_itself_catches_a_missing_all_reduce_and_stops_its_workers():
    """The real stage on its own (not shadowed by the thread stage), with a notebook-defined
    function shipped by value into the spawned workers."""
    fn = _notebook_function("""
        def forward(x, shard, attend, all_reduce):
            return S.attention_forward(x, shard, attend, lambda t: t)
    """, "forward")
    blocks = [A.build_block(c) for c in A.FORWARD_CASES[:1]]
    shards = [[b.expected_shard(r) for r in range(2)] for b in blocks]
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    results = Fw.run_processes(fn, blocks, shards)
    with pytest.raises(Exception, match="the all-reduce is missing"):
        Fw.diagnose(blocks[0], shards[0], results[0], "2 gloo processes")
    assert results[0][0][1] == [] and results[0][1][1] == []  # no collectives were made
    left = {p.pid for p in psutil.Process().children(recursive=True)} - before
    assert not [p for p in left if _alive_worker(p)]


def _alive_worker(pid: int) -> bool:
    """A live child other than multiprocessing's resource tracker, which the first ``spawn``
    in a process starts and keeps for the process's lifetime (not a worker left behind)."""
    try:
        proc = psutil.Process(pid)
        return (proc.status() != psutil.STATUS_ZOMBIE
                and "resource_tracker" not in " ".join(proc.cmdline()))
    except psutil.NoSuchProcess:
        return False


def test_unequal_all_reduce_counts_time_out_with_a_clear_message(monkeypatch):
    counter = itertools.count()

    def first_rank_reduces_twice(x, shard, attend, all_reduce):
        first = next(counter) == 0  # atomic: exactly one thread rank gets 0
        y = S.attention_forward(x, shard, attend, all_reduce)
        return all_reduce(y) if first else y

    real = Fw._Board.__init__
    monkeypatch.setattr(Fw._Board, "__init__", lambda self, world: real(self, world, 0.5))
    result = Fw.check_forward(first_rank_reduces_twice, processes=False)
    assert not result.passed
    assert "every rank must make the same all_reduce calls" in result.message


def test_labkit_row_parallel_linear_passes_the_checker():
    """Cross-check: a forward built on labkit.parallel.layers.RowParallelLinear (the engine's
    o_proj on a rank) passes, so the checker and the engine agree on where the sum goes."""
    from labkit.parallel.layers import RowParallelLinear

    class Group:  # RowParallelLinear's view of a TPGroup, over the checker's all_reduce
        def __init__(self, all_reduce):
            self.all_reduce = lambda t, site="": all_reduce(t)

    def forward(x, shard, attend, all_reduce):
        q = F.linear(x, shard["q_proj.weight"], shard.get("q_proj.bias"))
        k = F.linear(x, shard["k_proj.weight"], shard.get("k_proj.bias"))
        v = F.linear(x, shard["v_proj.weight"], shard.get("v_proj.bias"))
        w = shard["o_proj.weight"]
        o = RowParallelLinear(w.shape[1], w.shape[0], "o_proj.bias" in shard, Group(all_reduce))
        o.weight.copy_(w)
        if o.bias is not None:
            o.bias.copy_(shard["o_proj.bias"])
        return o(attend(q, k, v))

    result = Fw.check_forward(forward, processes=False)
    assert result.passed, result.message

"""Exercise 12: shard one attention block for tensor parallelism, and place its all-reduce.

``check_shard`` compares the learner's slices of q/k/v/o with ``labkit.parallel`` (``make_plan``
and ``slice_spec``, the layout the parallel engine loads) on MHA, GQA and MQA blocks over 2 and
4 ranks, and names the mistake: o_proj split by its outputs, KV heads not divided (or not
replicated when there are fewer than ranks), heads taken interleaved, a query head's KV head on
another rank. ``check_forward`` runs the learner's per-rank forward with the ranks as threads of
this process first (fast, precise diagnoses: a missing or doubled all-reduce, the bias added
before it, an all-reduce of q/k/v), then for real on 2 processes over torch.distributed (gloo,
``labkit.parallel.workers``), and compares every rank's output with the unsharded labkit
``Attention`` block. The workers are spawned: run the check from a script only under
``if __name__ == "__main__":``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from labkit.exercises.checks import CheckFailure, call, run_check
from labkit.exercises.inject import inject as _inject
from labkit.model.config import ModelConfig
from labkit.model.llama import Attention, apply_rope, causal_attention, rope_cos_sin
from labkit.parallel.plan import make_plan
from labkit.parallel.shard import StateDictSource, slice_spec

NOTEBOOK = "12_tensor_parallel_attention"
ORDER = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
         "q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias")


def inject(name: str, learner: Any) -> Any:
    """The reference under ``LABKIT_INJECT_SOLUTIONS=1`` (CI), else the learner's own."""
    return _inject(name, learner, "tp_attention_solutions")


@dataclass(frozen=True)
class Case:
    """One attention block to split. ``bias``: "none", "qwen2" (q/k/v) or "llama" (q/k/v/o)."""

    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    world: int
    bias: str = "none"
    seed: int = 0
    tokens: int = 6

    def config(self) -> ModelConfig:
        return ModelConfig(vocab_size=8, hidden_size=self.hidden, intermediate_size=8,
                           num_hidden_layers=1, num_attention_heads=self.heads,
                           num_key_value_heads=self.kv_heads, head_dim=self.head_dim,
                           attention_bias=self.bias != "none",
                           architecture="Qwen2ForCausalLM" if self.bias == "qwen2"
                           else "LlamaForCausalLM")

    def __str__(self) -> str:
        kind = "MHA" if self.heads == self.kv_heads else "MQA" if self.kv_heads == 1 else "GQA"
        bias = {"none": "no bias", "qwen2": "q/k/v bias", "llama": "q/k/v/o bias"}[self.bias]
        return (f"{kind} block: hidden {self.hidden}, {self.heads} query heads, {self.kv_heads} "
                f"KV heads, head_dim {self.head_dim}, {bias}, over {self.world} ranks")


SHARD_CASES = [Case(32, 4, 4, 8, 2, seed=0), Case(32, 8, 2, 4, 2, "qwen2", seed=1),
               Case(32, 8, 4, 4, 4, seed=2), Case(32, 4, 1, 8, 2, "llama", seed=3),
               Case(48, 8, 2, 6, 4, "llama", seed=4)]
FORWARD_CASES = [Case(32, 8, 2, 4, 2, "qwen2", seed=5), Case(32, 4, 1, 8, 2, "llama", seed=6),
                 Case(32, 4, 4, 8, 2, seed=7)]


@dataclass
class Block:
    """A case's unsharded block: its weights, an input and the block's output on it."""

    case: Case
    weights: dict[str, torch.Tensor]
    x: torch.Tensor
    full: torch.Tensor

    def expected_shard(self, rank: int) -> dict[str, torch.Tensor]:
        plan = make_plan(self.case.config(), self.case.world, rank)
        src = StateDictSource(self.weights)
        return {n: src.read(n, slice_spec(n, plan)) for n in self.weights}


def build_block(case: Case) -> Block:
    torch.manual_seed(case.seed)
    attn = Attention(case.config(), 0).eval()
    with torch.no_grad():
        for n, p in attn.named_parameters():
            if n.endswith("bias"):
                p.normal_(std=0.5)  # large enough that a bias counted twice shows
        x = torch.randn(case.tokens, case.hidden)
        pos = torch.arange(case.tokens)[None]
        cos, sin = rope_cos_sin(pos, case.head_dim, 10000.0, torch.float32)
        full = attn(x[None], cos, sin, pos, None)[0]
    weights = {n: p.detach().clone() for n, p in attn.named_parameters()}
    return Block(case, dict(sorted(weights.items(), key=lambda kv: ORDER.index(kv[0]))), x, full)


@dataclass(frozen=True)
class Attend:
    """RoPE + causal attention over one rank's heads: q [T, nq*d], k/v [T, nkv*d] -> [T, nq*d]."""

    head_dim: int
    theta: float = 10000.0

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        d = self.head_dim
        if q.dim() != 2 or k.shape != v.shape or q.shape[0] != k.shape[0]:
            raise ValueError(f"attend(q, k, v) takes [tokens, heads*head_dim] tensors with k and "
                             f"v alike; got q {list(q.shape)}, k {list(k.shape)}, v "
                             f"{list(v.shape)}")
        if q.shape[1] % d or k.shape[1] % d or (q.shape[1] // d) % max(k.shape[1] // d, 1) \
                or k.shape[1] == 0:
            raise ValueError(f"attend: q has {q.shape[1]} columns and k/v {k.shape[1]}; each "
                             f"must be whole heads of {d}, every KV head serving the same number "
                             "of query heads")
        T = q.shape[0]
        pos = torch.arange(T)[None]
        cos, sin = rope_cos_sin(pos, d, self.theta, q.dtype)
        q4, k4, v4 = (t.reshape(1, T, -1, d) for t in (q, k, v))
        out = causal_attention(apply_rope(q4, cos, sin), apply_rope(k4, cos, sin), v4)
        return out.reshape(T, -1)


# ---- part 1: the slices --------------------------------------------------------------------
def _rows_of(full: torch.Tensor, part: torch.Tensor, dim: int) -> list[int | None]:
    """For each row (dim 0) or column (dim 1) of ``part``, its index in ``full`` (None: absent)."""
    f, p = (full, part) if dim == 0 else (full.T, part.T)
    eq = (p[:, None, :] == f[None, :, :]).all(-1)
    return [int(r.nonzero()[0]) if r.any() else None for r in eq]


def _span(idx: list[int | None], head_dim: int) -> str:
    if idx and None not in idx and idx == list(range(idx[0], idx[0] + len(idx))) \
            and idx[0] % head_dim == 0:
        return f"heads {idx[0] // head_dim}..{(idx[-1] + 1) // head_dim - 1}"
    shown = ", ".join("?" if i is None else str(i) for i in idx[:10])
    return f"[{shown}{', …' if len(idx) > 10 else ''}]"


def _shape_hint(name: str, c: Case, got: tuple[int, ...]) -> str:
    d, w = c.head_dim, c.world
    if name == "o_proj.weight":
        if got and got[0] != c.hidden:
            return ("that splits o_proj by its outputs (column-parallel). o_proj is ROW-parallel: "
                    "every rank keeps all hidden outputs and takes the input columns of its own "
                    "query heads, weight[:, my heads' rows], so its product is a partial sum")
        return "o_proj.weight keeps all hidden rows and the columns of this rank's query heads"
    if name == "o_proj.bias":
        return ("o_proj's bias is not split: every rank keeps the whole bias and adds it once, "
                "after the all-reduce")
    if name.startswith(("k_proj", "v_proj")):
        if got and got[0] == c.kv_heads * d:
            return (f"KV heads are not divided: a rank keeps only the KV heads its query heads "
                    f"read, num_kv_heads / world = {c.kv_heads}/{w} of them (a copy of one when "
                    "there are fewer KV heads than ranks); this is what shrinks the KV cache")
        if c.kv_heads < w:
            return (f"{c.kv_heads} KV head(s) over {w} ranks: each rank keeps a copy of the ONE "
                    "KV head its query heads read (whole heads cannot be split further)")
    if name.startswith("q_proj") and got and got[0] == c.heads * d:
        return f"split the query heads: num_heads / world = {c.heads // w} whole heads per rank"
    return "q/k/v (and their biases) are split by whole heads along their output rows"


def _value_hint(name: str, c: Case, rank: int, got_idx: list[int | None],
                want_idx: list[int]) -> str:
    d = c.head_dim
    have = sorted(i for i in got_idx if i is not None)
    if None in got_idx:
        return "some of them are not rows of the full tensor: slice it, do not transform it"
    if have != list(range(have[0], have[0] + len(have))) or have != got_idx:
        return ("a head's head_dim rows are contiguous in the weight (head h = rows h*head_dim "
                "... (h+1)*head_dim - 1); you took them interleaved (a view(head_dim, heads, ...)"
                " or a strided slice?)")
    if name.startswith(("k_proj", "v_proj")):
        group = c.heads // c.kv_heads
        q0 = rank * (c.heads // c.world)
        q1 = q0 + c.heads // c.world - 1
        return (f"rank {rank}'s query heads {q0}..{q1} read KV heads {q0 // group}..{q1 // group}"
                f" (query head h reads KV head h // (num_heads / num_kv_heads) = h // {group})")
    if name == "o_proj.weight":
        return "o_proj's input columns are those of this rank's query heads (its q_proj rows)"
    return f"rank r owns query heads r*(num_heads/world) ... : rank {rank} owns " + \
        _span(want_idx, d)


def _combined_error(block: Block, shards: list[dict[str, torch.Tensor]]) -> float | None:
    """max |Δ| between the unsharded output and the sum of the ranks' partial outputs (None if
    the slices do not even fit together)."""
    try:
        with torch.no_grad():
            att = Attend(block.case.head_dim)
            total = sum(partial_output(block.x, s, att) for s in shards)
            if "o_proj.bias" in block.weights:
                total = total + block.weights["o_proj.bias"]
            return float((total - block.full).abs().max())
    except Exception:  # noqa: BLE001 - shapes that do not fit: no number to report
        return None


def _combined_note(err: float | None) -> str:
    if err is None:
        return ""
    if err < 1e-4:
        return ("; the ranks' partial outputs still sum to the block's output (a consistent "
                "permutation), but not in the layout labkit's KV cache and loader use")
    return f"; the ranks' partial outputs then sum to a wrong output (max |Δ| {err:.3g})"


def partial_output(x: torch.Tensor, s: dict[str, torch.Tensor], attend: Attend) -> torch.Tensor:
    q = F.linear(x, s["q_proj.weight"], s.get("q_proj.bias"))
    k = F.linear(x, s["k_proj.weight"], s.get("k_proj.bias"))
    v = F.linear(x, s["v_proj.weight"], s.get("v_proj.bias"))
    return F.linear(attend(q, k, v), s["o_proj.weight"])


def learner_shards(shard_attention: Callable, block: Block) -> list[dict[str, torch.Tensor]]:
    c, out = block.case, []
    for rank in range(c.world):
        got = call(shard_attention, {k: v.clone() for k, v in block.weights.items()}, c.heads,
                   c.kv_heads, c.head_dim, rank, c.world,
                   _label=f"shard_attention(<{c}>, rank={rank}, world={c.world})")
        if not isinstance(got, dict):
            raise CheckFailure("return a dict name -> tensor", inputs=str(c),
                               expected="{'q_proj.weight': ..., ...}", actual=got)
        out.append(got)
    return out


def compare_shards(block: Block, shards: list[dict[str, torch.Tensor]]) -> None:
    c = block.case
    for rank, got in enumerate(shards):
        want = block.expected_shard(rank)
        for name, e in want.items():
            where = f"{c}; rank {rank}"
            g = got.get(name)
            if not isinstance(g, torch.Tensor):
                raise CheckFailure(f"rank {rank}'s shard has no tensor {name!r}", inputs=where,
                                   expected=f"tensor {list(e.shape)}", actual=g,
                                   hint="return every tensor of the block, biases too")
            if tuple(g.shape) != tuple(e.shape):
                raise CheckFailure(f"wrong shape of {name} on rank {rank}", inputs=where,
                                   expected=list(e.shape), actual=list(g.shape),
                                   hint=_shape_hint(name, c, tuple(g.shape)))
            if g.dtype != e.dtype:
                raise CheckFailure(f"{name} on rank {rank} changed dtype", inputs=where,
                                   expected=e.dtype, actual=g.dtype,
                                   hint="slice the tensors; do not convert them")
            if torch.equal(g, e):
                continue
            if name == "o_proj.bias":
                raise CheckFailure(f"rank {rank}'s o_proj.bias is not the block's", inputs=where,
                                   expected=e, actual=g, hint=_shape_hint(name, c, ()) + " (a "
                                   "bias on rank 0 only, added before the all-reduce, also sums "
                                   "right, but this contract keeps it whole on every rank)")
            dim = 1 if name == "o_proj.weight" else 0
            full = block.weights[name]
            if full.dim() == 1:  # biases: compare as one-element rows
                full, g2, e2 = full[:, None], g[:, None], e[:, None]
            else:
                g2, e2 = g, e
            got_idx, want_idx = _rows_of(full, g2, dim), _rows_of(full, e2, dim)
            tail = _combined_note(_combined_error(block, shards))
            kind = "columns" if dim else "rows"
            raise CheckFailure(f"rank {rank} holds the wrong {kind} of {name}{tail}",
                               inputs=where, expected=f"{kind} {_span(want_idx, c.head_dim)}",
                               actual=f"{kind} {_span(got_idx, c.head_dim)}",
                               hint=_value_hint(name, c, rank, got_idx, want_idx))


def check_shard(shard_attention: Callable) -> Any:
    """Part 1: the learner's slices equal labkit's plan on MHA, GQA and MQA blocks."""
    def body() -> str:
        for case in SHARD_CASES:
            block = build_block(case)
            compare_shards(block, learner_shards(shard_attention, block))
        return (f"your slices equal labkit.parallel's plan on {len(SHARD_CASES)} blocks (MHA, "
                "GQA, MQA; 2 and 4 ranks; KV heads divided or replicated; biases).")

    return run_check("tp_shard_attention", body)

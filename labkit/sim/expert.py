"""Expert parallelism on paper: what a mixture of experts costs on N GPUs, in one node or many.

Expert parallelism (EP) gives each of N ranks E/N whole experts of every MoE layer, so the
tokens must travel: each (token, expert) pair is *dispatched* to its expert's rank and the output
*combined* back, two all-to-alls per MoE layer. Summed over the ranks each one carries

    all_to_all_bytes = tokens · top_k · hidden · dtype_bytes            (each direction)

the formula :mod:`labkit.parallel.expert` counts on the engine's real all-to-alls (``T`` = the
step's tokens; :func:`all_to_all_bytes` is the one function both sides use). With experts
picked uniformly, a rank keeps 1/N of what it sends, (G-1)/N crosses NVLink to the other GPUs
of its node (G per node) and (N-G)/N leaves the node through its own NIC. The two links run in
parallel, so one all-to-all takes ``max(nvlink share / nvlink bw, nic share / nic bw)`` at the
rank that receives the most, plus a hop's latency. Links (one direction, per GPU):

- NVLink 4 on H100 / H200 SXM: 900 GB/s bidirectional per GPU = 450 GB/s each way, through
  NVSwitch to any GPU of the node (NVIDIA H100 / H200 datasheets).
- ConnectX-7, one per GPU: 400 Gb/s = 50 GB/s each way, InfiniBand NDR or RoCE 400 GbE
  (NVIDIA ConnectX-7 datasheet; DGX H100/H200 nodes carry eight). Nine times slower than NVLink:
  why a second node costs EP more than its bandwidth share suggests.

Tensor parallelism (TP) of the same model instead all-reduces ``tokens · hidden`` twice a layer
(after attention and after the MLP; :func:`labkit.sim.parallel.ring_allreduce_s`), and across
nodes its ring runs at the NIC's speed.

**Imbalance.** The router does not spread tokens evenly: some experts are hot. The rank holding
the hottest experts receives the most rows, computes the most, and every other rank waits for it
at the combine, so a step costs what the *slowest* rank costs: ``max/mean`` of the per-rank load
is the slowdown of the expert part. :func:`sample_expert_load` draws a seeded load with a Zipf
skew (s = 0 uniform); a measured load (the engine's trace ``expert_load``) can be passed instead.

**EPLB** (DeepSeek's expert-parallel load balancer): give R extra slots to copies of the hottest
experts (each copy takes an equal share of that expert's tokens), then pack the E + R replicas
onto the ranks heaviest first, each onto the least-loaded rank with a free slot. It buys a lower
max/mean and step time; it costs R/N more experts' weights per GPU. :func:`eplb` is that
algorithm; ``ep_plan`` compares it with the engine's contiguous placement (rank r holds experts
r·E/N ..).

Stated simplifications: the same load in every MoE layer; senders spread evenly over the ranks;
no overlap of communication with compute; activations are not weights (``act_bytes``, bf16 by
default: DeepSeek dispatches in FP8, which halves the dispatch); the expert part is a roofline
of the experts held (all touched) and the rows received.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from labkit.sim.parallel import LINKS, LinkPreset, ring_allreduce_s
from labkit.sim.presets import GiB as GIB
from labkit.sim.presets import GPUPreset, ModelPreset, MoEPreset, get_gpu, get_model_preset


def all_to_all_bytes(tokens: int, top_k: int, hidden: int, dtype_bytes: int) -> int:
    """Payload of one MoE layer's dispatch (the combine moves the same back), summed over ranks:
    every (token, slot) pair's hidden state is sent once."""
    if min(tokens, top_k, hidden, dtype_bytes) < 0:
        raise ValueError("tokens, top_k, hidden and dtype_bytes must be >= 0")
    return tokens * top_k * hidden * dtype_bytes


def _link(link: LinkPreset | str) -> LinkPreset:
    return LINKS[link] if isinstance(link, str) else link


def all_to_all_s(recv_bytes: float, world: int, gpus_per_node: int,
                 scale_up: LinkPreset | str = "nvlink4",
                 scale_out: LinkPreset | str = "ib-ndr") -> float:
    """Seconds for one all-to-all at a rank receiving ``recv_bytes`` from senders spread evenly
    over ``world`` ranks: its own 1/N is a local copy, (G-1)/N comes over NVLink, (N-G)/N over
    its NIC, in parallel (0 for one rank)."""
    if world < 1 or gpus_per_node < 1 or recv_bytes < 0:
        raise ValueError("world and gpus_per_node must be >= 1, recv_bytes >= 0")
    if world == 1:
        return 0.0
    g = min(gpus_per_node, world)
    up, out = _link(scale_up), _link(scale_out)
    intra = recv_bytes * (g - 1) / world / up.bandwidth
    inter = recv_bytes * (world - g) / world / out.bandwidth
    return max(intra, inter) + (out.hop_latency_s if world > g else up.hop_latency_s)


def sample_expert_load(num_experts: int, tokens: int, top_k: int, skew: float = 1.0,
                       seed: int = 0) -> list[int]:
    """Rows each expert receives when ``tokens`` tokens each pick ``top_k`` distinct experts,
    with popularity ∝ 1/rank^skew over a seeded random order of the experts (skew 0: uniform).
    Sampled without replacement per token (Gumbel top-k), so the loads sum to tokens·top_k."""
    if top_k > num_experts or min(num_experts, top_k) < 1 or tokens < 0 or skew < 0:
        raise ValueError(f"need 1 <= top_k <= num_experts, tokens >= 0, skew >= 0; got "
                         f"E={num_experts}, k={top_k}, T={tokens}, skew={skew}")
    rng = np.random.default_rng(seed)
    logp = -skew * np.log(rng.permutation(num_experts) + 1.0)
    keys = logp + rng.gumbel(size=(tokens, num_experts))
    chosen = np.argpartition(-keys, top_k - 1, axis=1)[:, :top_k]
    return np.bincount(chosen.ravel(), minlength=num_experts).tolist()


def contiguous_rank_load(load: list[float], ranks: int) -> list[float]:
    """Per-rank rows under the engine's placement: rank r holds experts r·E/N .. (r+1)·E/N-1."""
    e = len(load)
    if ranks < 1 or e % ranks:
        raise ValueError(f"{e} experts do not divide over {ranks} ranks")
    per = e // ranks
    return [float(sum(load[r * per:(r + 1) * per])) for r in range(ranks)]


@dataclass(frozen=True)
class Placement:
    """EPLB's answer: copies of each expert, which rank holds each replica, rows per rank."""

    replicas: list[int]                   # [E] copies of each expert (>= 1)
    rank_experts: list[list[int]]         # [N] the expert of each replica a rank holds
    rank_load: list[float]                # [N] rows each rank receives


def eplb(load: list[float], ranks: int, redundant: int = 0) -> Placement:
    """DeepSeek's EPLB: replicate (each of ``redundant`` extra slots goes to the expert whose
    rows per copy are highest), pack (replicas heaviest first, each onto the least-loaded rank
    with one of its (E+R)/N slots free), then swap replicas between the busiest rank and another
    while that lowers the busier of the two. A balancer never deploys a placement worse than the
    one running: if the result's busiest rank is not lighter than under the engine's contiguous
    placement (small E/N by chance already balanced), that placement is kept, with no copies
    (the spare slots stay empty)."""
    e = len(load)
    if ranks < 1 or redundant < 0 or e % ranks or redundant % ranks:
        raise ValueError(f"{e} experts and {redundant} redundant must each divide over "
                         f"{ranks} ranks")
    replicas = [1] * e
    for _ in range(redundant):
        hot = max(range(e), key=lambda i: load[i] / replicas[i])
        replicas[hot] += 1
    items = sorted((i for i in range(e) for _ in range(replicas[i])),
                   key=lambda i: load[i] / replicas[i], reverse=True)
    slots, rank_experts = (e + redundant) // ranks, [[] for _ in range(ranks)]
    for i in items:
        r = min((r for r in range(ranks) if len(rank_experts[r]) < slots),
                key=lambda r: _rows(rank_experts[r], load, replicas))
        rank_experts[r].append(i)
    _swap_down(rank_experts, load, replicas)
    if max(contiguous_rank_load(load, ranks)) <= max(_rows(x, load, replicas)
                                                     for x in rank_experts):
        per, replicas = e // ranks, [1] * e
        rank_experts = [list(range(r * per, (r + 1) * per)) for r in range(ranks)]
    return Placement(replicas, rank_experts,
                     [_rows(x, load, replicas) for x in rank_experts])


def _rows(experts: list[int], load: list[float], replicas: list[int]) -> float:
    return float(sum(load[i] / replicas[i] for i in experts))


def _swap_down(rank_experts: list[list[int]], load: list[float], replicas: list[int]) -> None:
    """Swap a replica of the busiest rank with one of another rank while the busier of the two
    ends up lighter than the busiest was (each swap strictly lowers the pair's max)."""
    share = [load[i] / replicas[i] for i in range(len(load))]
    for _ in range(4 * sum(map(len, rank_experts))):
        rows = [sum(share[i] for i in x) for x in rank_experts]
        top = max(range(len(rows)), key=rows.__getitem__)
        best = None
        for r, x in enumerate(rank_experts):
            for a, i in enumerate(rank_experts[top]):
                for b, j in enumerate(x):
                    d = share[i] - share[j]
                    pair = max(rows[top] - d, rows[r] + d)
                    if r != top and d > 0 and pair < rows[top] and (best is None or
                                                                     pair < best[0]):
                        best = (pair, r, a, b)
        if best is None:
            return
        _, r, a, b = best
        rank_experts[top][a], rank_experts[r][b] = rank_experts[r][b], rank_experts[top][a]


def imbalance(rank_load: list[float]) -> float:
    """max/mean of the per-rank load: how much longer the slowest rank takes than the average
    (1.0 = perfectly balanced)."""
    mean = sum(rank_load) / len(rank_load)
    return max(rank_load) / mean if mean else 1.0


@dataclass(frozen=True)
class EPPlan:
    """One MoE model served with EP over ``gpus`` GPUs (``nodes`` of ``gpus_per_node``);
    times are per step of ``tokens`` tokens, bytes per GPU unless named otherwise."""

    model: str
    gpu: str
    gpus: int
    nodes: int
    attention: str                # "dp" (replicated, own sequences) or "tp" (split)
    redundant: int                # EPLB's extra expert slots in all
    experts_per_gpu: int          # routed experts a GPU holds in each MoE layer, copies included
    weights_per_gpu: float
    fits: bool
    why: str                      # the memory sum behind ``fits``
    kv_per_token_per_gpu: int     # a token's KV on a GPU that holds it
    max_kv_tokens: int            # tokens of KV the whole deployment holds
    tokens: int
    dispatch_bytes: int           # one MoE layer's dispatch, all ranks (= the combine)
    cross_node_share: float       # of those bytes, the part that leaves its node
    all_to_all_s: float           # dispatch + combine, every MoE layer, balanced load
    attention_allreduce_s: float  # TP attention's all-reduce per layer (0 with DP attention)
    tp_allreduce_s: float         # the same model all tensor parallel: 2 all-reduces a layer
    imbalance: float              # max/mean rows per rank, engine's contiguous placement
    imbalance_eplb: float         # the same after EPLB with ``redundant`` copies
    moe_balanced_s: float         # the expert part of a step if every rank had the mean load
    moe_s: float                  # the same with the slowest rank setting the pace
    moe_eplb_s: float             # and after EPLB
    eplb_extra_bytes_per_gpu: float  # what the copies cost in memory


def _moe_layer_s(rows: float, experts: int, m: MoEPreset, g: GPUPreset, recv_bytes: float,
                 world: int, gpus_per_node: int, scale_up: str, scale_out: str) -> float:
    """One rank, one MoE layer: dispatch in, its experts over ``rows`` rows, combine out."""
    flops = 2.0 * m.expert_params * rows
    weights = experts * m.expert_params * m.dtype_bytes
    a2a = all_to_all_s(recv_bytes, world, gpus_per_node, scale_up, scale_out)
    return 2 * a2a + max(flops / g.peak_flops, weights / g.mem_bandwidth)


def _memory(m: MoEPreset, g: GPUPreset, n: int, attention: str, copy_bytes: float,
            utilization: float) -> tuple[float, bool, str, int, int]:
    """Weights per GPU (experts / N, the rest replicated under DP attention or split under TP),
    whether they fit, why, a token's KV on a GPU, and the deployment's KV tokens."""
    dense = m.weight_bytes - m.routed_expert_bytes
    weights = (dense if attention == "dp" else dense / n) + m.routed_expert_bytes / n + copy_bytes
    budget = g.mem_bytes * utilization
    fits = weights < budget
    why = (f"{weights / GIB:.1f} GiB of weights per GPU {'<' if fits else '>='} "
           f"{budget / GIB:.1f} GiB ({utilization:.0%} of {g.mem_bytes / GIB:.0f})")
    kv_tok = m.kv_bytes_per_token_per_gpu(1 if attention == "dp" else n)
    holders = n if attention == "dp" else 1  # DP: each GPU its own sequences' KV
    return weights, fits, why, kv_tok, int(holders * (budget - weights) // kv_tok) if fits else 0


def _check_layout(m: ModelPreset, attention: str, gpus: int, gpus_per_node: int, tokens: int,
                  context: int, redundant: int) -> None:
    """Refuse what expert parallelism cannot cost: a dense model, an unknown attention layout,
    a count below 1, experts (or copies) that do not divide over the GPUs."""
    if not isinstance(m, MoEPreset):
        raise ValueError(f"{m.name} is dense: expert parallelism needs a mixture of experts")
    if attention not in ("dp", "tp") or min(gpus, gpus_per_node, tokens, context) < 1:
        raise ValueError("attention must be 'dp' or 'tp'; gpus, gpus_per_node, tokens and "
                         "context must be >= 1")
    if m.num_experts % gpus or redundant % gpus:
        raise ValueError(f"{m.num_experts} experts (+{redundant} copies) do not divide over "
                         f"{gpus} GPUs")


def ep_plan(model: MoEPreset | str, gpu: GPUPreset | str, gpus: int, *,
            gpus_per_node: int = 8, tokens: int = 4096, attention: str = "dp",
            load: list[float] | None = None, skew: float = 1.0, seed: int = 0,
            redundant: int = 0, context: int = 4096, act_bytes: int = 2,
            scale_up: str = "nvlink4", scale_out: str = "ib-ndr",
            gpu_memory_utilization: float = 0.9) -> EPPlan:
    """Cost ``model`` with its experts spread over ``gpus`` GPUs: memory, all-to-all beside TP's
    all-reduce, and the imbalance of ``load`` (rows per expert; default sampled with ``skew``
    and ``seed`` for ``tokens`` tokens) before and after EPLB with ``redundant`` copies."""
    m, g = get_model_preset(model), get_gpu(gpu)
    _check_layout(m, attention, gpus, gpus_per_node, tokens, context, redundant)
    n, nodes = gpus, -(-gpus // gpus_per_node)
    per_gpu = (m.num_experts + redundant) // n
    copy_bytes = m.moe_layers * m.expert_params * m.dtype_bytes * redundant / n
    weights, fits, why, kv_tok, max_kv = _memory(m, g, n, attention, copy_bytes,
                                                  gpu_memory_utilization)
    load = sample_expert_load(m.num_experts, tokens, m.num_experts_per_tok, skew, seed) \
        if load is None else load
    if len(load) != m.num_experts:
        raise ValueError(f"load has {len(load)} experts, {m.name} has {m.num_experts}")
    row = m.hidden_size * act_bytes
    scale = tokens * m.num_experts_per_tok / max(sum(load), 1e-12)  # rows of this step
    plain = [x * scale for x in contiguous_rank_load(load, n)]
    packed = eplb(load, n, redundant)
    balanced_rows = tokens * m.num_experts_per_tok / n

    def layer_s(rows: float, experts: int) -> float:
        return _moe_layer_s(rows, experts, m, g, rows * row, n, gpus_per_node, scale_up,
                            scale_out)

    ring = scale_up if n <= gpus_per_node else scale_out
    act = tokens * m.hidden_size * act_bytes
    attn_ar = 0.0 if attention == "dp" else m.num_layers * ring_allreduce_s(act, n, ring)
    return EPPlan(
        m.name, g.name, n, nodes, attention, redundant, per_gpu, weights, fits, why, kv_tok,
        max_kv, tokens, all_to_all_bytes(tokens, m.num_experts_per_tok, m.hidden_size,
                                         act_bytes),
        (n - min(gpus_per_node, n)) / n,
        m.moe_layers * 2 * all_to_all_s(balanced_rows * row, n, gpus_per_node, scale_up,
                                        scale_out),
        attn_ar, 2 * m.num_layers * ring_allreduce_s(act, n, ring),
        imbalance(plain), imbalance(packed.rank_load),
        m.moe_layers * layer_s(balanced_rows, m.num_experts // n),
        m.moe_layers * layer_s(max(plain), m.num_experts // n),
        m.moe_layers * layer_s(max(packed.rank_load) * scale, per_gpu), copy_bytes)


def ep_table(model: str = "deepseek-v3", gpu: str = "h200", layouts: tuple[int, ...] = (8, 16),
             **kw) -> list[dict[str, float | int | str | bool]]:
    """The seeds' question as rows (one per GPU count, e.g. one node of 8 vs two of 8):
    memory, all-to-all vs TP all-reduce, imbalance and what EPLB buys. ``kw`` goes to
    :func:`ep_plan`; numbers are GiB, MB and ms so a DataFrame reads directly."""
    rows = []
    for n in layouts:
        p = ep_plan(model, gpu, n, **kw)
        rows.append({
            "gpus": p.gpus, "nodes": p.nodes, "fits": p.fits, "weights_GiB_per_gpu":
            p.weights_per_gpu / GIB, "kv_tokens": p.max_kv_tokens,
            "dispatch_MB_per_layer": p.dispatch_bytes / 1e6,
            "cross_node_share": p.cross_node_share, "all_to_all_ms": 1e3 * p.all_to_all_s,
            "tp_allreduce_ms": 1e3 * p.tp_allreduce_s, "imbalance": p.imbalance,
            "imbalance_eplb": p.imbalance_eplb, "moe_ms": 1e3 * p.moe_s,
            "moe_eplb_ms": 1e3 * p.moe_eplb_s, "moe_balanced_ms": 1e3 * p.moe_balanced_s})
    return rows


def eplb_curve(model: str = "deepseek-v3", gpu: str = "h200", gpus: int = 8,
               redundant: tuple[int, ...] = (0, 8, 16, 32, 64), **kw) -> list[dict[str, float]]:
    """max/mean, expert-part time and extra memory per GPU as EPLB gets more copies."""
    out = []
    for r in redundant:
        p = ep_plan(model, gpu, gpus, redundant=r, **kw)
        out.append({"redundant": r, "imbalance": p.imbalance_eplb, "moe_ms": 1e3 * p.moe_eplb_s,
                    "extra_GiB_per_gpu": p.eplb_extra_bytes_per_gpu / GIB})
    return out

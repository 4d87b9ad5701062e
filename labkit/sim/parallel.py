"""Parallel plans on paper: what tensor and pipeline parallelism cost a model on N GPUs.

Tensor parallelism (TP) splits every layer's matrices over N GPUs of one node; each layer then
ends in two all-reduces of the activations (after attention and after the MLP). A ring
all-reduce of ``b`` bytes moves ``2(N-1)/N · b`` bytes through each GPU's link and takes
``2(N-1)`` hops, so

    allreduce_s = 2(N-1)/N · b / link_bandwidth + 2(N-1) · hop_latency

which is cheap on NVLink and expensive on PCIe: why TP stays inside a node. KV heads are split
too, but only down to one per GPU: past ``N = num_kv_heads`` every GPU keeps a copy, so the KV
cache per GPU stops shrinking (Llama-3-8B, 8 KV heads: TP=16 saves no more KV than TP=8).

Pipeline parallelism (PP) gives each of S stages a run of whole layers; activations cross a
stage boundary once per micro-batch (a point-to-point send, no all-reduce), so it tolerates slow
inter-node links. Its price is the bubble. A training step (or a batch of prefills) that is
cut into m micro-batches and then flushed leaves (S-1)/(m+S-1) of the time idle (GPipe's
formula). Decoding never flushes, but a sequence's next token cannot enter stage 1 before its
last one left stage S: with m decode micro-batches in flight, stages idle 1 - m/S of the time
until m >= S. Either way PP adds throughput, never per-token latency; TP cuts latency.

Everything below is the roofline of labkit.sim.cost, divided by the split, plus the
communication. Stated simplifications: no overlap of communication with compute; the
embedding and LM head are split with the layers (vocab-parallel for TP, first/last stage for PP,
charged evenly); activation memory is ignored.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.sim.cost import STEP_OVERHEAD_S
from labkit.sim.presets import GPUPreset, ModelPreset, get_gpu, get_model_preset


@dataclass(frozen=True)
class LinkPreset:
    """One direction of a GPU's link: bytes/s, and the latency one ring hop adds."""

    name: str
    bandwidth: float
    hop_latency_s: float
    source: str = ""


LINKS: dict[str, LinkPreset] = {
    k.name: k for k in (
        LinkPreset("nvlink4", 450e9, 1e-6, "H100 SXM NVLink 4: 900 GB/s total, 450 GB/s each "
                   "way; ~1 us a hop puts an 8-GPU small all-reduce near NCCL's ~15 us"),
        LinkPreset("nvlink3", 300e9, 1e-6, "A100 SXM NVLink 3: 600 GB/s total, 300 GB/s each way"),
        LinkPreset("pcie5", 64e9, 5e-6, "PCIe 5.0 x16: 64 GB/s each way (about 50 effective)"),
        LinkPreset("pcie4", 32e9, 5e-6, "PCIe 4.0 x16: 32 GB/s each way"),
        LinkPreset("ib-ndr", 50e9, 5e-6, "InfiniBand NDR 400 Gb/s per GPU: 50 GB/s each way, "
                   "between nodes"),
    )
}


def ring_allreduce_s(nbytes: float, n: int, link: LinkPreset | str) -> float:
    """Seconds for a ring all-reduce of ``nbytes`` over ``n`` GPUs (0 for one GPU)."""
    link = LINKS[link] if isinstance(link, str) else link
    if n < 1 or nbytes < 0:
        raise ValueError(f"need n >= 1 and nbytes >= 0, got n={n}, nbytes={nbytes}")
    if n == 1:
        return 0.0
    return 2 * (n - 1) / n * nbytes / link.bandwidth + 2 * (n - 1) * link.hop_latency_s


def bubble_fraction(stages: int, microbatches: int) -> float:
    """Idle fraction of a flushed (GPipe-style) pipeline of m micro-batches: (S-1)/(m+S-1)."""
    if stages < 1 or microbatches < 1:
        raise ValueError("stages and microbatches must be >= 1")
    return (stages - 1) / (microbatches + stages - 1)


@dataclass(frozen=True)
class ParallelPlan:
    model: str
    gpu: str
    tp: int
    pp: int
    microbatches: int            # decode batches in flight (one per stage keeps PP full)
    weights_per_gpu: float       # bytes
    kv_per_token_per_gpu: float  # bytes
    max_kv_tokens: int           # tokens of KV the deployment holds (0 if weights don't fit)
    max_batch: int               # sequences of `context` tokens that fit
    tpot_s: float                # one decode token of one sequence: every stage, end to end
    allreduce_s: float           # TP communication inside that
    tokens_per_s: float          # decode throughput (0 if the batch does not fit)
    ttft_s: float                # prefill of one `prompt`-token request
    idle: float                  # steady-state stage idle fraction, 1 - min(m, S)/S

    @property
    def gpus(self) -> int:
        return self.tp * self.pp

    @property
    def fits(self) -> bool:
        return self.max_batch > 0


def kv_heads_per_gpu(m: ModelPreset, tp: int) -> int:
    """KV heads each TP rank holds: split while there are enough, then one copy per GPU."""
    return max(1, m.num_kv_heads // tp)


def plan(model: ModelPreset | str, gpu: GPUPreset | str, tp: int = 1, pp: int = 1, *,
         batch: int = 64, context: int = 2048, prompt: int = 1024,
         link: str = "nvlink4", pp_link: str = "nvlink4", microbatches: int | None = None,
         gpu_memory_utilization: float = 0.9) -> ParallelPlan:
    """The cost of ``model`` with TP=tp inside each of pp stages; ``batch`` sequences in all,
    cut into ``microbatches`` (default pp) that follow each other through the stages, each
    sequence at ``context`` tokens. Same ``batch`` for every layout, so plans compare fairly:
    a micro-batch re-reads its stage's weights, so memory-bound decode gains nothing from PP."""
    m, g = get_model_preset(model), get_gpu(gpu)
    mb = pp if microbatches is None else microbatches
    if min(tp, pp, batch, context, prompt, mb) < 1:
        raise ValueError("tp, pp, batch, context, prompt and microbatches must be >= 1")
    if m.num_heads % tp or m.num_layers % pp:
        raise ValueError(f"{m.name}: {m.num_heads} heads over tp={tp} or {m.num_layers} layers "
                         f"over pp={pp} do not divide")
    n, layers = tp * pp, m.num_layers // pp
    weights = m.weight_bytes / n
    kv_tok = m.kv_bytes_per_token_per_gpu(tp, layers)
    free = g.mem_bytes * gpu_memory_utilization - weights
    max_kv = int(free // kv_tok) if free > 0 else 0  # a stage's GPUs hold the same tokens
    mbatch = -(-batch // mb)  # sequences per micro-batch
    act = mbatch * m.hidden_size * m.dtype_bytes
    ar = pp * 2 * layers * ring_allreduce_s(act, tp, link)
    hop = LINKS[pp_link]
    p2p = (pp - 1) * (act / hop.bandwidth + hop.hop_latency_s)
    flops = (2.0 * m.active_params * mbatch + 4.0 * m.num_layers * m.num_heads * m.head_dim
             * mbatch * context) / n
    mem_s = (m.weight_bytes_read(mbatch) / n + kv_tok * mbatch * context) / g.mem_bandwidth
    tpot = pp * max(mem_s, flops / g.peak_flops) + ar + p2p + STEP_OVERHEAD_S
    in_flight = min(mb, pp)
    fits = max_kv // context >= batch
    pf_flops = (2.0 * m.active_params * prompt + 2.0 * m.num_layers * m.num_heads * m.head_dim
                * prompt * prompt) / n
    pf_act = prompt * m.hidden_size * m.dtype_bytes
    ttft = pp * (max(pf_flops / g.peak_flops, weights / g.mem_bandwidth)
                 + 2 * layers * ring_allreduce_s(pf_act, tp, link)) \
        + (pp - 1) * (pf_act / hop.bandwidth + hop.hop_latency_s) + STEP_OVERHEAD_S
    return ParallelPlan(m.name, g.name, tp, pp, mb, weights, kv_tok, max_kv, max_kv // context,
                        tpot, ar, in_flight * mbatch / tpot if fits else 0.0, ttft,
                        1 - in_flight / pp)


def compare(model: str, gpu: str, layouts: list[tuple[int, int]], **kw) -> list[ParallelPlan]:
    """Plans for several (tp, pp) layouts, e.g. [(4, 1), (8, 1), (4, 2), (2, 4)]."""
    return [plan(model, gpu, tp, pp, **kw) for tp, pp in layouts]

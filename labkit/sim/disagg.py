"""Prefill/decode disaggregation on the roofline: DistServe-style goodput, colocated vs P:D.

Why goodput: a serving system is judged by how many requests per second it completes *within
its latency targets*, not by raw tokens/s. DistServe (Zhong et al., OSDI 2024) names it: the
highest arrival rate at which a given fraction (say 90%) of requests meet both a TTFT SLO
(time to first token: the prefill) and a TPOT SLO (time per output token: the decode).

Why disaggregation can win: a colocated engine (vLLM without chunked prefill, prefill first)
stops every running decode while it prefills a new prompt, so the TPOT of running requests
includes the prefills of everyone who arrived meanwhile; a tight TPOT SLO then caps the rate.
Running prompts on *prefill* GPUs and decoding on *decode* GPUs removes that interference, at
three prices: the KV cache must move from one GPU to the other, each phase gets only its share
of the GPUs, and a 1:1 split leaves the prefill GPU idle when decodes are the bottleneck (and
vice versa). Which wins is a question of the SLOs, the lengths and the link: this module
answers it for a named model and GPU with :mod:`labkit.sim.cost`'s roofline step times.

**KV bytes per request** = prompt tokens x ``2 * layers * kv_heads * head_dim * dtype_bytes``
(K and V, every layer; Llama-3-8B in bf16: 2 * 32 * 8 * 128 * 2 = 131,072 bytes = 128 KiB a
token, so a 1,024-token prompt moves 128 MiB). Transfer time = bytes / link bandwidth + one
latency; transfers from one prefill GPU go one at a time over its link, overlapping its next
prefill (DistServe and vLLM's connectors send while computing).

**Links** (one direction, the bandwidth a single GPU's transfer sees):

- ``nvlink4``: 450 GB/s, NVLink 4 on H100 SXM (900 GB/s bidirectional per GPU; NVIDIA H100
  datasheet) - prefill and decode GPUs in one node;
- ``pcie5``: 64 GB/s, PCIe 5.0 x16 (PCI-SIG; about 50 effective) - GPUs without NVLink, via
  the host;
- ``ib-ndr`` (400 Gb/s): 50 GB/s, one ConnectX-7 NIC per GPU, InfiniBand NDR / 400 GbE
  (NVIDIA ConnectX-7 datasheet; DGX H100 carries eight) - across nodes;
- ``eth-100g``: 12.5 GB/s, 100 GbE (a ConnectX-6 Dx class NIC) - a commodity cluster.

The first three are :data:`labkit.sim.parallel.LINKS`; latency 1 us (NVLink) or 5-10 us.

**The model, and what it leaves out.** Requests arrive Poisson (seeded; the same unit-rate
draws scaled by 1/rate for every rate: common random numbers, so the curves are smooth),
prompt and output lengths uniform in the given ranges. Each instance runs vLLM v0's loop: a
prefill step of waiting prompts (FIFO, up to ``max_num_batched_tokens``) whenever any wait,
else one decode step of every running request; a step's time is ``cost.step_time`` (compute
or memory roof + 0.5 ms overhead). Colocated: ``num_gpus`` such instances, requests dealt
round robin. Disaggregated: P prefill-only instances, then the transfer, then D decode-only
instances (round robin each). Admission reserves a request's whole KV (prompt + output) in
``cost.max_kv_tokens`` and at most 256 requests run (no preemption). TTFT is arrival -> the
decode instance admits the request (its KV has landed and a slot is free): the client streams
from the decode instance (labkit's router; vLLM's disaggregated proxy), and counting the wait
for a decode slot here makes an overloaded decode side visible at once, as it would be through
backpressure, instead of only late in a finite trace. TPOT = (finish - first token) /
(output - 1). Not modelled: chunked prefill (Sarathi-Serve's answer to the same interference,
which trades some TTFT for bounded stalls), the prefill GPU's memory holding KV that waits for
a decode slot, tensor parallelism.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass

import numpy as np

from labkit.sim.cost import max_kv_tokens, step_time
from labkit.sim.parallel import LINKS, LinkPreset
from labkit.sim.presets import GPUPreset, ModelPreset, get_gpu, get_model_preset

KV_LINKS: dict[str, LinkPreset] = {
    "nvlink4": LINKS["nvlink4"], "pcie5": LINKS["pcie5"], "ib-ndr": LINKS["ib-ndr"],
    "eth-100g": LinkPreset("eth-100g", 12.5e9, 10e-6, "100 GbE: 12.5 GB/s each way"),
}


def kv_bytes_per_request(model: ModelPreset | str, prompt_tokens: int) -> int:
    """KV a prefill instance sends for a ``prompt_tokens``-token prompt (every layer, K and V)."""
    if prompt_tokens < 0:
        raise ValueError(f"prompt_tokens must be >= 0, got {prompt_tokens}")
    return prompt_tokens * get_model_preset(model).kv_bytes_per_token


def transfer_s(nbytes: float, link: LinkPreset | str) -> float:
    """Seconds to move ``nbytes`` over one direction of ``link`` (bandwidth + one latency)."""
    if isinstance(link, str):
        if link not in KV_LINKS:
            raise ValueError(f"unknown link {link!r}; known: {sorted(KV_LINKS)}")
        link = KV_LINKS[link]
    return nbytes / link.bandwidth + link.hop_latency_s


@dataclass
class SimRequest:
    arrival: float
    prompt_len: int
    output_len: int
    ready: float = 0.0         # when it may start the current phase (arrival, or KV landed)
    first_token: float = -1.0  # absolute time the client has its first token
    finish: float = -1.0
    generated: int = 0

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def tpot(self) -> float:
        return (self.finish - self.first_token) / max(self.output_len - 1, 1)


@dataclass(frozen=True)
class Deployment:
    """``prefill`` and ``decode`` GPUs (``prefill=0``: colocated on ``decode`` GPUs)."""

    prefill: int
    decode: int
    link: str = "nvlink4"

    @property
    def num_gpus(self) -> int:
        return self.prefill + self.decode

    @property
    def name(self) -> str:
        return f"colocated x{self.decode}" if self.prefill == 0 else \
            f"{self.prefill}P:{self.decode}D {self.link}"


class _Instance:
    """One GPU running vLLM v0's loop; ``mode`` is colocated, prefill or decode.

    Decode steps are counted, not looped over per request: a request that joins at step ``s``
    with ``g`` tokens finishes at step ``s + output_len - g`` (a heap), and the context the
    step reads grows by the batch size each step, so a step costs O(log n), not O(n)."""

    def __init__(self, model: ModelPreset, gpu: GPUPreset, mode: str, max_num_seqs: int = 256,
                 max_batched_tokens: int = 8192) -> None:
        self.model, self.gpu, self.mode = model, gpu, mode
        self.max_num_seqs, self.max_batched_tokens = max_num_seqs, max_batched_tokens
        self.running: list[tuple[int, int, SimRequest]] = []  # heap: (finish step, id, req)
        self.ctx = 0  # KV tokens the running requests hold
        self.reserved = 0  # ... and will hold when done: admission keeps this under capacity
        self.capacity = max_kv_tokens(model, gpu)
        self.steps = 0  # decode steps so far

    def _fits(self, r: SimRequest, held: int = 0, count: int = 0) -> bool:
        """Room for ``r`` (beside ``count`` requests holding ``held`` tokens being admitted)."""
        need = r.prompt_len + r.output_len
        if need > self.capacity:
            raise ValueError(f"a request of {need} tokens exceeds the {self.capacity}-token KV "
                             f"cache of {self.model.name} on {self.gpu.name}")
        return len(self.running) + count < self.max_num_seqs and \
            self.reserved + held + need <= self.capacity

    def _join(self, r: SimRequest) -> None:
        self.reserved += r.prompt_len + r.output_len
        heapq.heappush(self.running, (self.steps + r.output_len - r.generated, id(r), r))
        self.ctx += r.prompt_len + r.generated

    def run(self, reqs: list[SimRequest]) -> None:
        """Simulate to completion; ``reqs`` in order of ``ready``."""
        pending, waiting, t = deque(reqs), deque(), 0.0
        while pending or waiting or self.running:
            while pending and pending[0].ready <= t:
                waiting.append(pending.popleft())
            if self.mode == "decode":
                while waiting and self._fits(waiting[0]):
                    r = waiting.popleft()
                    r.first_token = t  # the client's first token streams from here
                    self._join(r)
            elif waiting and (self.mode == "prefill" or self._fits(waiting[0])):
                t = self._prefill(waiting, t)
                continue
            if self.running:
                t = self._decode(t)
            elif pending:
                t = max(t, pending[0].ready)

    def _prefill(self, waiting: deque, t: float) -> float:
        batch, tokens, held = [], 0, 0
        while waiting and (not batch or tokens + waiting[0].prompt_len
                           <= self.max_batched_tokens):
            r = waiting.popleft()
            if self.mode == "colocated" and not self._fits(r, held, len(batch)):
                waiting.appendleft(r)
                break
            batch.append(r)
            tokens += r.prompt_len
            held += r.prompt_len + r.output_len
        pairs = sum(r.prompt_len * (r.prompt_len + 1) // 2 for r in batch)
        t += step_time(self.model, self.gpu, tokens, 0, 0, attention_pairs=pairs)
        for r in batch:
            r.generated, r.first_token = 1, t  # prefill mode: moved on by the transfer
            if self.mode == "colocated" and r.output_len > 1:
                self._join(r)
            else:
                r.finish = t  # done (one token), or the prefill instance is done with it
        return t

    def _decode(self, t: float) -> float:
        n = len(self.running)
        t += step_time(self.model, self.gpu, 0, n, self.ctx)
        self.steps += 1
        self.ctx += n
        while self.running and self.running[0][0] <= self.steps:
            _, _, r = heapq.heappop(self.running)
            r.generated, r.finish = r.output_len, t
            self.ctx -= r.prompt_len + r.output_len
            self.reserved -= r.prompt_len + r.output_len
        return t


def make_requests(n: int, rate: float, prompt_range: tuple[int, int],
                  output_range: tuple[int, int], seed: int = 0) -> list[SimRequest]:
    """``n`` requests, Poisson at ``rate``/s: the same seeded unit-rate gaps scaled by 1/rate."""
    if rate <= 0 or n < 1:
        raise ValueError(f"need rate > 0 and n >= 1, got rate={rate}, n={n}")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0, n)) / rate
    p = rng.integers(prompt_range[0], prompt_range[1] + 1, n)
    o = rng.integers(output_range[0], output_range[1] + 1, n)
    return [SimRequest(float(a), int(pl), int(ol), ready=float(a))
            for a, pl, ol in zip(arrivals, p, o)]


def simulate_deployment(dep: Deployment, reqs: list[SimRequest], model: str = "llama-3-8b",
                        gpu: str = "h100-sxm") -> list[SimRequest]:
    """Run ``reqs`` (modified in place, and returned) through the deployment."""
    m, g = get_model_preset(model), get_gpu(gpu)
    if dep.prefill < 0 or dep.decode < 1:
        raise ValueError(f"need prefill >= 0 and decode >= 1 GPUs, got {dep}")
    if dep.prefill == 0:
        for i in range(dep.decode):
            _Instance(m, g, "colocated").run(reqs[i::dep.decode])
        return reqs
    for i in range(dep.prefill):  # prefill, then one transfer at a time on this GPU's link
        mine = reqs[i::dep.prefill]
        _Instance(m, g, "prefill").run(mine)
        link_free = 0.0
        for r in sorted(mine, key=lambda r: r.first_token):
            start = max(r.first_token, link_free)
            link_free = start + transfer_s(kv_bytes_per_request(m, r.prompt_len), dep.link)
            r.first_token = r.ready = link_free
            r.finish = -1.0 if r.output_len > 1 else link_free
    landed = sorted((r for r in reqs if r.output_len > 1), key=lambda r: r.ready)
    for i in range(dep.decode):
        _Instance(m, g, "decode").run(landed[i::dep.decode])
    return reqs


def attainment(reqs: list[SimRequest], ttft_slo: float, tpot_slo: float) -> float:
    """Fraction of requests meeting both SLOs (DistServe's SLO attainment)."""
    ok = sum(1 for r in reqs if r.ttft <= ttft_slo and r.tpot <= tpot_slo)
    return ok / len(reqs)


@dataclass(frozen=True)
class Workload:
    """Lengths, SLOs and the sample size behind one goodput number."""

    prompt_range: tuple[int, int] = (512, 2048)
    output_range: tuple[int, int] = (64, 512)
    ttft_slo: float = 0.4
    tpot_slo: float = 0.04
    num_requests: int = 400
    seed: int = 0


def attainment_at(dep: Deployment, rate: float, wl: Workload, model: str = "llama-3-8b",
                  gpu: str = "h100-sxm") -> float:
    reqs = make_requests(wl.num_requests, rate, wl.prompt_range, wl.output_range, wl.seed)
    return attainment(simulate_deployment(dep, reqs, model, gpu), wl.ttft_slo, wl.tpot_slo)


def goodput(dep: Deployment, wl: Workload, target: float = 0.9, model: str = "llama-3-8b",
            gpu: str = "h100-sxm", iters: int = 10) -> float:
    """The highest arrival rate (requests/s, the whole deployment) whose SLO attainment is at
    least ``target``: double from 0.5/s until it fails, then bisect ``iters`` times between the
    last rate that passed and the first that failed (0.0 if even a trickle fails). A looser SLO
    passes at every rate a tighter one passes, so the search is monotone in the SLOs."""
    if not 0 < target <= 1:
        raise ValueError(f"target attainment must be in (0, 1], got {target}")
    lo, hi = 0.0, 0.5
    while attainment_at(dep, hi, wl, model, gpu) >= target:
        lo, hi = hi, hi * 2
        if hi > 4096:
            return lo
    for _ in range(iters):
        mid = (lo + hi) / 2
        if attainment_at(dep, mid, wl, model, gpu) >= target:
            lo = mid
        else:
            hi = mid
    return lo


def frontier(wl: Workload, links: tuple[str, ...] = tuple(KV_LINKS), target: float = 0.9,
             model: str = "llama-3-8b", gpu: str = "h100-sxm",
             colocated_gpus: tuple[int, ...] = (1, 2)) -> list[dict]:
    """Goodput (total and per GPU) of colocated engines and of 1:1, 1:2, 2:1 over each link."""
    deps = [Deployment(0, n) for n in colocated_gpus]
    deps += [Deployment(p, d, link) for link in links for p, d in ((1, 1), (1, 2), (2, 1))]
    rows = []
    for dep in deps:
        g = goodput(dep, wl, target, model, gpu)
        rows.append({"deployment": dep.name, "prefill_gpus": dep.prefill,
                     "decode_gpus": dep.decode, "link": dep.link if dep.prefill else None,
                     "gpus": dep.num_gpus, "goodput_rps": g, "goodput_per_gpu": g / dep.num_gpus})
    return rows

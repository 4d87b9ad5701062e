"""Named GPUs and models for the simulator: the few numbers a roofline needs.

Why these numbers and no others: an LLM step is either compute-bound (prefill: a matmul over many
tokens) or memory-bound (decode: every weight is read once to produce one token per sequence), so
peak dense FLOP/s, HBM bandwidth and capacity decide a GPU's place on the roofline, and a model's
parameter count and KV-cache geometry decide how much work and how many bytes each step moves.

GPU figures are the vendors' datasheet peaks (dense, i.e. without the 2:4 sparsity doubling):

- A100-SXM-80GB: 312 TFLOP/s bf16 tensor core, 80 GB HBM2e, 2,039 GB/s
  (NVIDIA A100 Tensor Core GPU datasheet, 2021).
- H100-SXM: 989 TFLOP/s bf16 tensor core (1,979 with sparsity), 80 GB HBM3, 3.35 TB/s
  (NVIDIA H100 Tensor Core GPU datasheet, 2023).
- H200-SXM: same Hopper compute as H100 (989 TFLOP/s bf16), 141 GB HBM3e, 4.8 TB/s
  (NVIDIA H200 Tensor Core GPU datasheet, 2024). A copy-bandwidth microbenchmark reaches about
  4.3 TB/s; the roofline uses the datasheet peak like the others.
- RTX-4090: 165.2 TFLOP/s bf16/fp16 tensor core with fp32 accumulate (330.3 with sparsity;
  NVIDIA Ada Lovelace architecture whitepaper, appendix table), 24 GB GDDR6X, 1,008 GB/s.

Capacities: the "80 GB" parts expose 81,920 MiB (80 GiB) to CUDA, so memory sizes are GiB; the
H200's 141 GB is likewise taken as 141 GiB and the 4090's 24 GB as 24 GiB.

Model geometry is copied from each model's public Hugging Face ``config.json``
(meta-llama/Llama-2-7b-hf, meta-llama/Meta-Llama-3-8B, Qwen/Qwen2.5-7B, meta-llama/Llama-2-70b-hf,
meta-llama/Llama-3.2-1B, TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T). Parameter counts
computed from it match the published counts exactly (tests/sim/test_presets.py).

Mixture-of-experts presets (:class:`MoEPreset`) come from the same kind of source:
mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen3-30B-A3B and deepseek-ai/DeepSeek-V3 ``config.json``
(``num_local_experts`` / ``num_experts`` / ``n_routed_experts``, ``num_experts_per_tok``,
``moe_intermediate_size``, ``n_shared_experts``, ``first_k_dense_replace``, and DeepSeek's MLA
ranks ``q_lora_rank`` 1536, ``kv_lora_rank`` 512, ``qk_rope_head_dim`` 64). Their totals match
the published counts: Mixtral 46,702,792,704 and Qwen3-30B-A3B 30,532,122,624 exactly;
DeepSeek-V3 671.03B against the report's "671B total, 37B activated", which leaves out the
multi-token-prediction module (one more MoE layer, 14B: the 685B on its model page).

The 2026 presets (issue 33), from each ``config.json``: openai/gpt-oss-120b (36 layers,
hidden 2880, 64 heads, 8 KV heads of 64, 128 experts of 2880, top-4, vocab 201,088,
``sliding_window`` 128 on ``layer_types`` ["sliding_attention", "full_attention"] x 18; MXFP4
experts, 4.25 bits a weight with one 8-bit scale per 32); google/gemma-3-27b-it ``text_config``
(62 layers, hidden 5376, 32 heads, 16 KV heads of 128, intermediate 21504, vocab 262,208,
``sliding_window`` 1024, ``sliding_window_pattern`` 6: every 6th layer full, so 10 full and 52
sliding); Qwen/Qwen3-32B (64 layers, hidden 5120, 64 heads, 8 KV heads of 128, intermediate
25600, vocab 151,936, no sliding window). Their KV geometry is exact; their parameter counts
are the formula's (gpt-oss: 116.79B, the published 116.83B less the attention/expert biases and
sinks; Gemma 3: 27.01B text, the norms beyond two per layer left out; Qwen3-32B: 32.76B).
A sliding layer holds at most ``sliding_window`` tokens: :meth:`ModelPreset.kv_bytes` counts
that, ``kv_bytes_per_token`` is what a cache that frees nothing pays.
"""

from __future__ import annotations

from dataclasses import dataclass

GiB = 1 << 30


@dataclass(frozen=True)
class GPUPreset:
    """A GPU on the roofline: peak dense FLOP/s, memory capacity (bytes), bandwidth (bytes/s)."""

    name: str
    peak_flops: float
    mem_bytes: int
    mem_bandwidth: float
    source: str = ""
    host_bandwidth: float = 25e9  # bytes/s GPU<->CPU, what KV swapping pays (PCIe, effective)

    @property
    def ridge_point(self) -> float:
        """FLOPs per byte where compute and memory time are equal; below it a kernel is
        memory-bound. Decode runs at ~1 FLOP/byte per sequence in the batch, far below."""
        return self.peak_flops / self.mem_bandwidth


@dataclass(frozen=True)
class ModelPreset:
    """A Llama-family decoder's shape, enough to count its FLOPs and bytes.

    ``dtype_bytes`` applies to both weights and the KV cache (2 = bf16/fp16)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    dtype_bytes: int = 2
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    max_position_embeddings: int = 4096
    sliding_window: int = 0  # 0: none; else the window of the num_sliding_layers sliding layers
    num_sliding_layers: int = 0

    def kv_bytes(self, num_tokens: int, tp: int = 1) -> int:
        """KV bytes one sequence of ``num_tokens`` holds on one of ``tp`` GPUs when every
        sliding layer keeps only its last ``sliding_window`` tokens (the rest freed)."""
        per_layer = self.kv_bytes_per_token_per_gpu(tp, layers=1)
        full = self.num_layers - self.num_sliding_layers
        held = min(num_tokens, self.sliding_window) if self.num_sliding_layers else 0
        return per_layer * (full * num_tokens + self.num_sliding_layers * held)

    @property
    def params_per_layer(self) -> int:
        """q/k/v/o projections, the SwiGLU MLP (gate, up, down) and two RMSNorm weights."""
        d = self.hidden_size
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        attn = d * q + 2 * d * kv + q * d
        if self.attention_bias:
            attn += q + 2 * kv
        return attn + 3 * d * self.intermediate_size + 2 * d

    @property
    def num_params(self) -> int:
        embed = self.vocab_size * self.hidden_size
        lm_head = 0 if self.tie_word_embeddings else embed
        return embed + lm_head + self.num_layers * self.params_per_layer + self.hidden_size

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies (the FLOPs' ``params``): all, for a dense model."""
        return self.num_params

    def weight_bytes_read(self, num_tokens: int) -> float:
        """Weight bytes a step of ``num_tokens`` reads: all of them for a dense model."""
        return float(self.weight_bytes)

    def kv_bytes_per_token_per_gpu(self, tp: int = 1, layers: int | None = None) -> int:
        """KV bytes one GPU holds per token when ``layers`` layers (default all) are split over
        ``tp`` ranks by KV head: down to one head per rank, then every rank keeps a copy."""
        layers = self.num_layers if layers is None else layers
        return 2 * layers * max(1, self.num_kv_heads // tp) * self.head_dim * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, every KV head: 2 · layers · kv_heads · head_dim · bytes.
        GQA is why Llama-3-8B needs 4x less KV per token than Llama-2-7B."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


@dataclass(frozen=True)
class MoEPreset(ModelPreset):
    """A mixture-of-experts decoder: the first ``first_k_dense`` layers keep a dense MLP of
    ``intermediate_size``, every later layer has ``num_experts`` routed SwiGLU experts of
    ``moe_intermediate_size`` (a token runs ``num_experts_per_tok`` of them) plus
    ``num_shared_experts`` that every token runs, and a router ``[num_experts, hidden]``.

    ``kv_lora_rank > 0`` means DeepSeek's multi-head latent attention (MLA): q goes through a
    rank-``q_lora_rank`` bottleneck, and the cache holds one compressed latent of
    ``kv_lora_rank`` plus one shared rotary key of ``qk_rope_head_dim`` per token and layer,
    instead of K and V per head. ``kv_dtype_bytes`` (0: ``dtype_bytes``) lets FP8 weights sit
    beside a bf16 cache, as DeepSeek-V3 is served."""

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    first_k_dense: int = 0
    router_bias: bool = False     # DeepSeek-V3's e_score_correction_bias, one per expert
    qk_norm: bool = False         # Qwen3's per-head RMSNorm on q and k
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    kv_dtype_bytes: int = 0
    expert_weight_bits: float = 0  # 0: dtype_bytes; gpt-oss's MXFP4 experts: 4.25

    @property
    def moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense

    @property
    def attn_params(self) -> int:
        """One layer's attention projections (and MLA's two norms / Qwen3's q/k norms)."""
        d, h = self.hidden_size, self.num_heads
        if not self.kv_lora_rank:
            q, kv = h * self.head_dim, self.num_kv_heads * self.head_dim
            return 2 * d * q + 2 * d * kv + (2 * self.head_dim if self.qk_norm else 0)
        qk = self.qk_nope_head_dim + self.qk_rope_head_dim  # head_dim is MLA's v_head_dim
        return (d * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * h * qk
                + d * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
                + self.kv_lora_rank * h * (self.qk_nope_head_dim + self.head_dim)
                + h * self.head_dim * d)

    @property
    def expert_params(self) -> int:
        """One SwiGLU expert: gate, up and down."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    def _moe_layer(self, experts_run: int) -> int:
        router = self.num_experts * self.hidden_size + (self.num_experts if self.router_bias
                                                         else 0)
        return (self.attn_params + router + 2 * self.hidden_size
                + (experts_run + self.num_shared_experts) * self.expert_params)

    def _params(self, experts_run: int) -> int:
        d = self.hidden_size
        embed = self.vocab_size * d * (1 if self.tie_word_embeddings else 2)
        dense = self.attn_params + 3 * d * self.intermediate_size + 2 * d
        return (embed + self.first_k_dense * dense + self.moe_layers * self._moe_layer(experts_run)
                + d)

    @property
    def num_params(self) -> int:
        return self._params(self.num_experts)

    @property
    def active_params(self) -> int:
        """What one token multiplies: top-k routed + shared experts, everything else whole
        (the embedding counted, as Mixtral's 12.9B and Qwen3's 3.3B count it)."""
        return self._params(self.num_experts_per_tok)

    @property
    def routed_expert_bytes(self) -> int:
        """Every routed expert of every MoE layer: what expert parallelism spreads over ranks."""
        n = self.moe_layers * self.num_experts * self.expert_params
        if self.expert_weight_bits:
            return int(n * self.expert_weight_bits / 8)
        return n * self.dtype_bytes

    @property
    def weight_bytes(self) -> int:
        """The routed experts at their own width (MXFP4 for gpt-oss), the rest at dtype_bytes."""
        routed = self.moe_layers * self.num_experts * self.expert_params
        return (self.num_params - routed) * self.dtype_bytes + self.routed_expert_bytes

    def weight_bytes_read(self, num_tokens: int) -> float:
        """A step reads the experts its tokens chose: with uniform routing a given expert is
        missed by all ``T`` tokens with probability ``(1 - k/E)^T``, so batch 1 reads about the
        active weights and a few hundred tokens read them all."""
        e, k = self.num_experts, self.num_experts_per_tok
        touched = e * (1 - (1 - k / e) ** max(num_tokens, 0))
        return float(self.weight_bytes - self.routed_expert_bytes
                     + self.routed_expert_bytes * touched / e)

    @property
    def kv_bytes_per_token(self) -> int:
        """GQA: K and V per KV head. MLA: one latent of kv_lora_rank + the shared rope key."""
        if not self.kv_lora_rank:
            return super().kv_bytes_per_token
        return self.num_layers * (self.kv_lora_rank + self.qk_rope_head_dim) * self._kv_bytes

    @property
    def _kv_bytes(self) -> int:
        return self.kv_dtype_bytes or self.dtype_bytes

    def kv_bytes_per_token_per_gpu(self, tp: int = 1, layers: int | None = None) -> int:
        """MLA's latent belongs to every head, so tensor parallelism cannot split it: each TP
        rank keeps the whole latent (why DeepSeek serves attention data parallel)."""
        layers = self.num_layers if layers is None else layers
        if self.kv_lora_rank:
            return layers * (self.kv_lora_rank + self.qk_rope_head_dim) * self._kv_bytes
        return 2 * layers * max(1, self.num_kv_heads // tp) * self.head_dim * self._kv_bytes


def _gpu(name: str, tflops: float, mem_gib: float, tb_per_s: float, source: str,
         host_gb_per_s: float = 25) -> GPUPreset:
    return GPUPreset(name, tflops * 1e12, int(mem_gib * GiB), tb_per_s * 1e12, source,
                     host_gb_per_s * 1e9)


GPUS: dict[str, GPUPreset] = {
    g.name: g
    for g in (
        _gpu("a100-80gb", 312, 80, 2.039, "NVIDIA A100 datasheet: 312 TF bf16, 80GB, 2039 GB/s"),
        _gpu("h100-sxm", 989, 80, 3.35, "NVIDIA H100 datasheet: 989 TF bf16, 80GB, 3.35 TB/s; "
             "PCIe 5.0 x16 to the host", 50),
        _gpu("h200-sxm", 989, 141, 4.8, "NVIDIA H200 datasheet: 989 TF bf16, 141GB, 4.8 TB/s; "
             "PCIe 5.0 x16 to the host", 50),
        _gpu("rtx-4090", 165.2, 24, 1.008,
              "Ada whitepaper: 165.2 TF bf16 fp32 acc, 24GB, 1008 GB/s"),
    )
}

MODELS: dict[str, ModelPreset] = {
    m.name: m
    for m in (
        ModelPreset("llama-2-7b", 32, 4096, 32, 32, 128, 11008, 32000),
        ModelPreset("llama-3-8b", 32, 4096, 32, 8, 128, 14336, 128256,
                    max_position_embeddings=8192),
        ModelPreset("qwen2.5-7b", 28, 3584, 28, 4, 128, 18944, 152064, attention_bias=True,
                    max_position_embeddings=32768),
        ModelPreset("llama-2-70b", 80, 8192, 64, 8, 128, 28672, 32000),
        # Small drafts for the speculative-decoding simulator.
        ModelPreset("llama-3.2-1b", 16, 2048, 32, 8, 64, 8192, 128256, tie_word_embeddings=True,
                    max_position_embeddings=131072),
        ModelPreset("tinyllama-1.1b", 22, 2048, 32, 4, 64, 5632, 32000,
                    max_position_embeddings=2048),
        # Mixtures of experts (positional: layers, hidden, heads, kv heads, head dim, dense
        # intermediate, vocab).
        MoEPreset("mixtral-8x7b", 32, 4096, 32, 8, 128, 14336, 32000,
                  max_position_embeddings=32768, num_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=14336),
        MoEPreset("qwen3-30b-a3b", 48, 2048, 32, 4, 128, 6144, 151936,
                  max_position_embeddings=40960, num_experts=128, num_experts_per_tok=8,
                  moe_intermediate_size=768, qk_norm=True),
        # FP8 weights (1 byte, as released; the block scales' 0.006% left out), bf16 MLA cache.
        MoEPreset("deepseek-v3", 61, 7168, 128, 128, 128, 18432, 129280, dtype_bytes=1,
                  max_position_embeddings=163840, num_experts=256, num_experts_per_tok=8,
                  moe_intermediate_size=2048, num_shared_experts=1, first_k_dense=3,
                  router_bias=True, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                  qk_rope_head_dim=64, kv_dtype_bytes=2),
        # issue 33: sliding windows (module docstring for the sources)
        MoEPreset("gpt-oss-120b", 36, 2880, 64, 8, 64, 2880, 201088,
                  max_position_embeddings=131072, num_experts=128, num_experts_per_tok=4,
                  moe_intermediate_size=2880, attention_bias=True, router_bias=True,
                  expert_weight_bits=4.25,
                  sliding_window=128, num_sliding_layers=18),
        ModelPreset("gemma-3-27b", 62, 5376, 32, 16, 128, 21504, 262208,
                    tie_word_embeddings=True, max_position_embeddings=131072,
                    sliding_window=1024, num_sliding_layers=52),
        ModelPreset("qwen3-32b", 64, 5120, 64, 8, 128, 25600, 151936,
                    max_position_embeddings=40960),
    )
}

# Spellings people type: "A100", "a100-sxm-80gb", "H100", "4090", "Llama-2-7B" ...
_GPU_ALIASES = {
    "a100": "a100-80gb", "a100-sxm-80gb": "a100-80gb", "a100-sxm": "a100-80gb",
    "h100": "h100-sxm", "h200": "h200-sxm", "4090": "rtx-4090", "rtx4090": "rtx-4090",
}
_MODEL_ALIASES = {"llama-3.1-8b": "llama-3-8b", "tinyllama": "tinyllama-1.1b",
                  "mixtral": "mixtral-8x7b", "qwen3-moe": "qwen3-30b-a3b",
                  "deepseek-v3-671b": "deepseek-v3", "deepseek": "deepseek-v3",
                  "gpt-oss": "gpt-oss-120b", "gemma-3": "gemma-3-27b", "qwen3": "qwen3-32b"}


def _normalise(name: str) -> str:
    return name.strip().lower().replace("_", "-").replace(" ", "-")


def _lookup(name: str, table: dict, aliases: dict[str, str], what: str):
    key = _normalise(name)
    key = aliases.get(key, key)
    if key not in table:
        raise ValueError(f"unknown {what} {name!r}; valid names: {', '.join(sorted(table))}")
    return table[key]


def get_gpu(name: str | GPUPreset) -> GPUPreset:
    """Look a GPU preset up by name (case-insensitive); ValueError lists the valid names."""
    return name if isinstance(name, GPUPreset) else _lookup(name, GPUS, _GPU_ALIASES, "GPU")


def get_model_preset(name: str | ModelPreset) -> ModelPreset:
    """Look a model preset up by name (case-insensitive); ValueError lists the valid names."""
    if isinstance(name, ModelPreset):
        return name
    return _lookup(name, MODELS, _MODEL_ALIASES, "model preset")


@dataclass(frozen=True)
class StoragePreset:
    """Where a new replica reads its weights from: sequential read bandwidth in bytes/s.

    Cold start (``cold_start_s``) is what autoscaling pays for every replica it adds: the weights
    cross the slowest of this link and the host-to-GPU link, after a fixed process start-up."""

    name: str
    bandwidth: float
    source: str = ""


STORAGE: dict[str, StoragePreset] = {
    s.name: s
    for s in (
        StoragePreset("nvme-gen4", 7.45e9, "Samsung 990 PRO datasheet: up to 7,450 MB/s "
                      "sequential read"),
        StoragePreset("network-100gbe", 12.5e9, "100 Gbit/s Ethernet line rate"),
        StoragePreset("network-25gbe", 3.125e9, "25 Gbit/s Ethernet line rate"),
        StoragePreset("network-10gbe", 1.25e9, "10 Gbit/s Ethernet line rate"),
    )
}

# Process start, CUDA context, memory profiling and CUDA-graph capture before the first request:
# our assumption, of the order vLLM's start-up log shows for an 8B model with its compile cache
# warm (about ten seconds; a cold torch.compile adds tens of seconds more).
DEFAULT_INIT_S = 10.0


def get_storage(name: str | StoragePreset) -> StoragePreset:
    """Look a storage preset up by name; ValueError lists the valid names."""
    return name if isinstance(name, StoragePreset) else _lookup(name, STORAGE, {}, "storage")


def cold_start_s(model: str | ModelPreset, gpu: str | GPUPreset,
                 storage: str | StoragePreset = "nvme-gen4",
                 init_s: float = DEFAULT_INIT_S) -> float:
    """Seconds from launching a replica to its first request: ``init_s`` plus the weight bytes
    over the slower of the storage link and the GPU's host link (the copy is pipelined)."""
    if init_s < 0:
        raise ValueError(f"init_s must be >= 0, got {init_s}")
    m, g, s = get_model_preset(model), get_gpu(gpu), get_storage(storage)
    return init_s + m.weight_bytes / min(s.bandwidth, g.host_bandwidth)

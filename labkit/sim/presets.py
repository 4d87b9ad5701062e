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
    def weight_bytes(self) -> int:
        return self.num_params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V, every layer, every KV head: 2 · layers · kv_heads · head_dim · bytes.
        GQA is why Llama-3-8B needs 4x less KV per token than Llama-2-7B."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


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
    )
}

# Spellings people type: "A100", "a100-sxm-80gb", "H100", "4090", "Llama-2-7B" ...
_GPU_ALIASES = {
    "a100": "a100-80gb", "a100-sxm-80gb": "a100-80gb", "a100-sxm": "a100-80gb",
    "h100": "h100-sxm", "h200": "h200-sxm", "4090": "rtx-4090", "rtx4090": "rtx-4090",
}
_MODEL_ALIASES = {"llama-3.1-8b": "llama-3-8b", "tinyllama": "tinyllama-1.1b"}


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

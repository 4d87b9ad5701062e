"""How many bytes a model needs: weights in a given format plus the KV cache.

The rule of thumb a learner should be able to do in their head: parameters × bytes per weight,
plus the per-group metadata (scales, zeros) that real formats carry, plus
``2 (K and V) × layers × kv_heads × head_dim × bytes × tokens`` for the cache. Byte counts here
are exact for labkit's own layers (tests/quant/test_memory.py checks them against the tensors of
a quantized model), so the calculator and the real thing cannot drift apart.
"""

from __future__ import annotations

from dataclasses import dataclass

from labkit.model.config import ModelConfig
from labkit.model.moe import refuse_moe
from labkit.quant.errors import QuantizationError, resolve_group_size

DTYPE_BYTES = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2,
               "int8": 1, "fp8": 1}
FORMATS = ("fp32", "fp16", "bf16", "int8", "fp8", "int4_rtn", "gptq", "awq", "nf4")

# Public config.json values of a few models learners ask about.
MODEL_CONFIGS = {
    "llama-2-7b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32),
    "llama-3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                       num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8),
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                       num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                       attention_bias=True, architecture="Qwen2ForCausalLM"),
    "llama-2-70b": dict(vocab_size=32000, hidden_size=8192, intermediate_size=28672,
                        num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8),
}


def get_config(model: ModelConfig | str) -> ModelConfig:
    if isinstance(model, ModelConfig):
        return model
    if model not in MODEL_CONFIGS:
        raise ValueError(f"unknown model {model!r}; choose one of {sorted(MODEL_CONFIGS)} or "
                         "pass a ModelConfig")
    return ModelConfig(**MODEL_CONFIGS[model])


def linear_shapes(config: ModelConfig) -> list[tuple[int, int, bool]]:
    """(out, in, has_bias) of every decoder linear (dense MLPs only: an MoE model's stacked
    experts are not linears, so it raises MoEUnsupportedError rather than under-count)."""
    refuse_moe(config, "the quantization memory estimate")
    h, i, d = config.hidden_size, config.intermediate_size, config.head_dim
    q, kv, b = config.num_attention_heads * d, config.num_key_value_heads * d, \
        config.attention_bias
    per_layer = [(q, h, b), (kv, h, b), (kv, h, b), (h, q, False),
                 (i, h, False), (i, h, False), (h, i, False)]
    return per_layer * config.num_hidden_layers


def linear_bytes(out_f: int, in_f: int, fmt: str, group_size: int = 128, blocksize: int = 64,
                 double_quant: bool = False, group_fallback: bool = False) -> int:
    """Bytes of one linear's weight (no bias) in ``fmt``, as labkit's layers store it."""
    n = out_f * in_f
    gs = in_f if group_size == -1 else group_size
    if fmt in ("int4_rtn", "gptq", "awq"):
        gs = resolve_group_size(in_f, group_size, group_fallback)
    groups = -(-in_f // gs)
    if fmt in ("fp32", "fp16", "bf16"):
        return n * DTYPE_BYTES[fmt]
    if fmt == "int8":  # int8 codes + fp16 scale per output channel
        return n + 2 * out_f
    if fmt == "fp8":  # e4m3 codes + fp32 scale per output channel
        return n + 4 * out_f
    if fmt in ("int4_rtn", "gptq", "awq"):  # nibbles + fp16 scales + packed zeros (+ g_idx)
        b = n // 2 + groups * out_f * 2 + groups * out_f // 2
        return b + (4 * in_f if fmt != "awq" else 0)
    if fmt == "nf4":
        blocks = -(-n // blocksize)
        absmax = blocks + 4 * -(-blocks // 256) + 4 if double_quant else 4 * blocks
        return -(-n // 2) + absmax
    raise QuantizationError(f"unknown format {fmt!r}; choose one of {FORMATS}")


@dataclass
class MemoryEstimate:
    quantized_bytes: int  # decoder linears in the chosen format
    other_bytes: int  # embeddings, lm_head, norms, biases in base_dtype
    kv_cache_bytes: int

    @property
    def weight_bytes(self) -> int:
        return self.quantized_bytes + self.other_bytes

    @property
    def total_bytes(self) -> int:
        return self.weight_bytes + self.kv_cache_bytes

    def as_dict(self) -> dict:
        return {"weight_bytes": self.weight_bytes, "quantized_bytes": self.quantized_bytes,
                "other_bytes": self.other_bytes, "kv_cache_bytes": self.kv_cache_bytes,
                "total_bytes": self.total_bytes, "total_gb": self.total_bytes / 1e9}


def kv_cache_bytes(model: ModelConfig | str, context_len: int, batch_size: int = 1,
                   kv_dtype: str = "fp16") -> int:
    """2 × layers × kv_heads × head_dim × bytes × tokens; "int8" adds an fp16 scale per
    (token, head) for K and for V (labkit.quant.kv_int8's per-head scheme)."""
    c = get_config(model)
    if kv_dtype not in DTYPE_BYTES:
        raise ValueError(f"kv_dtype {kv_dtype!r} unknown; choose one of {sorted(DTYPE_BYTES)}")
    if context_len < 0 or batch_size < 1:
        raise ValueError("context_len must be >= 0 and batch_size >= 1")
    per_head = c.head_dim * DTYPE_BYTES[kv_dtype] + (2 if kv_dtype == "int8" else 0)
    return 2 * c.num_hidden_layers * c.num_key_value_heads * per_head * context_len * batch_size


def estimate_memory(model: ModelConfig | str, fmt: str = "fp16", context_len: int = 0,
                    batch_size: int = 1, kv_dtype: str = "fp16", base_dtype: str = "fp16",
                    group_size: int = 128, blocksize: int = 64,
                    double_quant: bool = False, group_fallback: bool = False) -> MemoryEstimate:
    """Weights in ``fmt`` (embeddings/lm_head/norms in ``base_dtype``, or in ``fmt`` itself
    for the float formats) + KV cache bytes.

    >>> round(estimate_memory("llama-2-7b", "fp16").weight_bytes / 1e9, 1)
    13.5
    >>> round(estimate_memory("llama-2-7b", "gptq").weight_bytes / 1e9, 1)
    3.9
    """
    c = get_config(model)
    if fmt not in FORMATS:
        raise QuantizationError(f"unknown format {fmt!r}; choose one of {FORMATS}")
    base = DTYPE_BYTES[fmt if fmt in ("fp32", "fp16", "bf16") else base_dtype]
    q = bias = 0
    for out_f, in_f, has_bias in linear_shapes(c):
        q += linear_bytes(out_f, in_f, fmt, group_size, blocksize, double_quant, group_fallback)
        bias += out_f if has_bias else 0
    emb = c.vocab_size * c.hidden_size * (1 if c.tie_word_embeddings else 2)
    norms = (2 * c.num_hidden_layers + 1) * c.hidden_size
    other = (emb + norms + bias) * base
    return MemoryEstimate(q, other, kv_cache_bytes(c, context_len, batch_size, kv_dtype))

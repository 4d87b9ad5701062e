"""labkit.model: the model and nothing about serving it (the layer just above errors / utils).

Owns the architecture config (``config.ModelConfig``, with each layer's ``LayerSpec``), the
layer layout that builds each layer from its spec (``layers``), the Llama-family decoder with its
``kv_cache.attend`` hook (``llama``), sampling filters (``sampling``), the reference
``generate`` with a contiguous cache that every engine path is compared with (``generate``),
checkpoint loading (``loader``) and the tokenizer (``tokenizer``). The sparse mixture-of-experts
MLP (``moe``), DeepSeek's latent attention (``mla``), DeepSeekMoE (``deepseek_moe``),
gpt-oss's clamped-SwiGLU MoE (``gpt_oss``) and Gemma 3's causal LM (``gemma3``, its own
decoder layer) register themselves with the layer layout or the model classes when
this package is imported."""

from labkit.model import moe  # noqa: F401, I001 - registers the "moe" MLP kind (needs llama)
from labkit.model import deepseek_moe, mla  # noqa: F401 - the "deepseek_moe" and "mla" kinds
from labkit.model import gemma3, gpt_oss  # noqa: F401 - Gemma 3's class, "gpt_oss_moe"
from labkit.model.config import ConfigError, ModelConfig
from labkit.model.generate import ContiguousKVCache, generate
from labkit.model.llama import LlamaForCausalLM
from labkit.model.loader import CheckpointError, load_pretrained
from labkit.model.sampling import apply_sampling_filters, sample_token
from labkit.model.tokenizer import Tokenizer

__all__ = ["ModelConfig", "ConfigError", "LlamaForCausalLM", "generate", "ContiguousKVCache",
           "load_pretrained", "CheckpointError", "apply_sampling_filters", "sample_token",
           "Tokenizer"]

"""The model: config, a Llama-family decoder, sampling, reference generation, loading."""

from labkit.model.config import ConfigError, ModelConfig
from labkit.model.generate import ContiguousKVCache, generate
from labkit.model.llama import LlamaForCausalLM
from labkit.model.loader import CheckpointError, load_pretrained
from labkit.model.sampling import apply_sampling_filters, sample_token
from labkit.model.tokenizer import Tokenizer

__all__ = ["ModelConfig", "ConfigError", "LlamaForCausalLM", "generate", "ContiguousKVCache",
           "load_pretrained", "CheckpointError", "apply_sampling_filters", "sample_token",
           "Tokenizer"]

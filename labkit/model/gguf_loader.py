"""Loading a GGUF file (llama.cpp's format) into labkit: config, weights and tokenizer.

A GGUF file is one header (key/value metadata: architecture numbers, the tokenizer's vocabulary
and merges) followed by tensors, each aligned so it can be used straight from a memory map. The
``gguf`` package's reader maps the file with ``np.memmap``: opening a 4 GB model reads only the
header, and a weight's pages come from disk the first time something touches them. labkit keeps
float32 tensors on that map (copy-on-write, so nothing is read that is not used) and dequantizes
block-quantized ones into float tensors.

Two things differ from a Hugging Face checkpoint besides names. llama.cpp stores q/k projection
rows of each head *interleaved* (pairs (2i, 2i+1) rotate together in its RoPE) where Hugging Face
uses two halves (i, i + d/2); the exporter permutes and this loader permutes back. And the
tokenizer is rebuilt from the token list and merges, not read from a tokenizer.json.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from labkit.model.config import ModelConfig
from labkit.model.llama import LlamaForCausalLM
from labkit.model.meta import empty_model
from labkit.model.tokenizer import Tokenizer

# Hugging Face parameter name -> llama.cpp tensor name ({i} = layer index)
LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight", "self_attn.o_proj.bias": "attn_output.bias",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight",
                "model.norm.weight": "output_norm.weight", "lm_head.weight": "output.weight"}
# GGUF general.architecture <-> labkit architecture. Mistral without a sliding window is Llama.
GGUF_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama",
             "Qwen2ForCausalLM": "qwen2"}
TOKEN_TYPE_CONTROL = 3


class GGUFError(ValueError):
    """A GGUF file labkit cannot load (or a model it cannot export); the message says why."""


def gguf_name(hf_name: str) -> str:
    """'model.layers.3.mlp.down_proj.weight' -> 'blk.3.ffn_down.weight'."""
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    parts = hf_name.split(".", 3)
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in LAYER_NAMES:
        return f"blk.{parts[2]}.{LAYER_NAMES[parts[3]]}"
    raise GGUFError(f"no llama.cpp name for parameter {hf_name!r}")


def rope_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Rows of each head from halves order (HF) to interleaved order (llama.cpp)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def rope_unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Inverse of :func:`rope_permute`."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2) \
        .reshape(w.shape)


def permute_heads(hf_name: str, config: ModelConfig) -> int | None:
    """How many heads to (un)permute this tensor over, or None if it is stored as is."""
    if GGUF_ARCH[config.architecture] != "llama":
        return None  # qwen2 uses llama.cpp's NEOX rope, which pairs halves like HF
    if ".q_proj." in hf_name:
        return config.num_attention_heads
    if ".k_proj." in hf_name:
        return config.num_key_value_heads
    return None


# ---- reading -------------------------------------------------------------------------------
def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def config_from_gguf(reader) -> ModelConfig:
    arch = _field(reader, "general.architecture")
    if arch not in ("llama", "qwen2"):
        raise GGUFError(f"GGUF architecture {arch!r} is not supported; labkit loads 'llama' "
                        "and 'qwen2' files")
    names = {t.name: t for t in reader.tensors}
    get = lambda k, d=None: _field(reader, f"{arch}.{k}", d)  # noqa: E731
    scaling = get("rope.scaling.type", "none")
    if scaling not in (None, "none"):
        raise GGUFError(f"{arch}.rope.scaling.type = {scaling!r}; labkit implements only the "
                        "default rotary embedding")
    hidden, heads = get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length", hidden // heads)
    if get("rope.dimension_count", head_dim) != head_dim:
        raise GGUFError("partial rotary embeddings (rope.dimension_count != head dim) are not "
                        "supported")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=int(names["token_embd.weight"].shape[1]), hidden_size=hidden,
        intermediate_size=get("feed_forward_length"), num_hidden_layers=get("block_count"),
        num_attention_heads=heads, num_key_value_heads=get("attention.head_count_kv", heads),
        head_dim=head_dim, max_position_embeddings=get("context_length", 2048),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon")),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        attention_bias=arch == "qwen2" or "blk.0.attn_q.bias" in names,
        tie_word_embeddings="output.weight" not in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"), eos_token_id=eos,
        architecture="Qwen2ForCausalLM" if arch == "qwen2" else "LlamaForCausalLM")


def tensor_to_numpy(t) -> np.ndarray:
    """A reader tensor as float32 numpy [rows, cols]: a view on the map if it is f32."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize

    shape = tuple(int(s) for s in reversed(t.shape))  # GGUF lists dims fastest-first
    if t.tensor_type == T.F32:
        return np.asarray(t.data).reshape(shape)
    return dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)


def tokenizer_from_gguf(reader) -> Tokenizer | None:
    """Rebuild a byte-level BPE tokenizer (GGUF 'gpt2' model) from the token list and merges."""
    from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as HFTokenizer

    kind = _field(reader, "tokenizer.ggml.model")
    if kind in (None, "none", "no_vocab"):
        return None
    if kind != "gpt2":
        raise GGUFError(f"tokenizer.ggml.model = {kind!r}; labkit rebuilds only byte-level BPE "
                        "('gpt2') tokenizers from GGUF")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    tok = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == TOKEN_TYPE_CONTROL])
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    if bos is not None and _field(reader, "tokenizer.ggml.add_bos_token", False):
        tok.post_processor = processors.TemplateProcessing(
            single=f"{tokens[bos]} $A", pair=f"{tokens[bos]} $A {tokens[bos]} $B",
            special_tokens=[(tokens[bos], bos)])
    return Tokenizer(tok, bos, eos)


def load_gguf(path: str | os.PathLike, dtype: torch.dtype | None = None,
              device: torch.device | str | None = None
              ) -> tuple[LlamaForCausalLM, Tokenizer | None]:
    """(model, tokenizer) from a .gguf file; tokenizer is None for a file with no vocabulary."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"no GGUF file at {str(path)!r}")
    try:
        reader = GGUFReader(path, "c")  # copy-on-write map: pages load when first touched
    except (ValueError, KeyError) as e:
        raise GGUFError(f"{path} is not a readable GGUF file: {e}") from e
    config = config_from_gguf(reader)
    with empty_model():
        model = LlamaForCausalLM(config)
    tensors = {t.name: t for t in reader.tensors}
    params = dict(model.named_parameters())
    for hf_name in list(params):
        name = gguf_name(hf_name)
        if hf_name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if name not in tensors:
            raise GGUFError(f"{path.name} has no tensor {name!r} (for {hf_name})")
        w = tensor_to_numpy(tensors[name])
        if (heads := permute_heads(hf_name, config)) is not None:
            w = rope_unpermute(w, heads)
        if w.shape != tuple(params[hf_name].shape):
            raise GGUFError(f"{name} has shape {w.shape}, the metadata implies "
                            f"{tuple(params[hf_name].shape)}")
        _set_param(model, hf_name, torch.from_numpy(w))
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model = model.to(device=device or "cpu", dtype=dtype or torch.float32)
    return model.eval(), tokenizer_from_gguf(reader)


def _set_param(model: torch.nn.Module, name: str, value: torch.Tensor) -> None:
    module_name, _, attr = name.rpartition(".")
    setattr(model.get_submodule(module_name), attr, torch.nn.Parameter(value, requires_grad=False))

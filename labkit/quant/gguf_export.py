"""Writing a labkit model as a GGUF file llama.cpp loads: ``export_gguf(model, path, type)``.

What goes in, in the order llama.cpp's own converter writes it:

1. architecture numbers under ``llama.*`` (or ``qwen2.*``): layers, widths, heads, RoPE base;
2. the tokenizer: every token string, its type (control tokens such as ``<|endoftext|>``), the
   BPE merges, BOS/EOS ids and whether to prepend BOS. labkit's tokenizer is GPT-2-style
   byte-level BPE, so the pre-tokenizer is declared as ``gpt-2`` (llama.cpp then splits text
   with the same regex before merging);
3. the tensors under llama.cpp's names, q/k rows permuted into its interleaved RoPE order, each
   encoded with the type :func:`labkit.quant.gguf.tensor_type` picks for the file type.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from labkit.model.gguf_loader import (
    GGUF_ARCH,
    TOKEN_TYPE_CONTROL,
    GGUFError,
    gguf_name,
    permute_heads,
    rope_permute,
)
from labkit.model.layers import layer_sliding_windows
from labkit.model.llama import LlamaForCausalLM
from labkit.model.moe import refuse_moe
from labkit.model.tokenizer import Tokenizer
from labkit.quant.gguf import FILE_TYPE_IDS, FILE_TYPES, encode_tensor, ggml_type, tensor_type

TOKEN_TYPE_NORMAL, TOKEN_TYPE_UNUSED = 1, 5


def gguf_tensors(model: LlamaForCausalLM) -> list[tuple[str, np.ndarray]]:
    """(llama.cpp name, float32 array) for every tensor, in the model's parameter order."""
    cfg = model.config
    out = []
    for hf_name, p in model.named_parameters(remove_duplicate=True):
        w = p.detach().float().cpu().numpy()
        if (heads := permute_heads(hf_name, cfg)) is not None:
            w = rope_permute(w, heads)
        out.append((gguf_name(hf_name), np.ascontiguousarray(w)))
    return out


def _check_exportable(model: LlamaForCausalLM) -> None:
    cfg = model.config
    if not isinstance(model, LlamaForCausalLM):
        raise GGUFError(f"export_gguf takes a labkit LlamaForCausalLM, got {type(model).__name__}"
                        " (quantized labkit models cannot be re-exported; export the float one)")
    refuse_moe(cfg, "GGUF export")
    if cfg.qk_norm:
        raise GGUFError("Qwen3's per-head q/k norms cannot be expressed in a llama GGUF")
    windows = layer_sliding_windows(cfg)
    if all(w is not None for w in windows):
        raise GGUFError("a Mistral sliding window cannot be expressed in a llama GGUF; export a "
                        "model with sliding_window=None")
    if any(w is not None for w in windows):
        sliding = [i for i, w in enumerate(windows) if w is not None]
        raise GGUFError(f"per-layer sliding windows (layers {sliding} slide) cannot be expressed "
                        "in a llama GGUF; export a model without sliding layers")


def _vocab(tokenizer: Tokenizer, vocab_size: int) -> tuple[list[str], list[int], list[str]]:
    """Token strings by id, their GGUF types, and the merges, from labkit's tokenizer.json."""
    spec = json.loads(tokenizer._tok.to_str())
    model, pre = spec.get("model", {}), spec.get("pre_tokenizer") or {}
    pres = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    if model.get("type") != "BPE" or [p.get("type") for p in pres] != ["ByteLevel"] \
            or pres[0].get("add_prefix_space"):
        raise GGUFError("labkit exports byte-level BPE tokenizers (GPT-2 style, no prefix "
                        f"space); this one is {model.get('type')} with pre-tokenizer {pre}")
    ids = {i: t for t, i in model["vocab"].items()}
    special = {a["id"] for a in spec.get("added_tokens", []) if a.get("special")}
    for a in spec.get("added_tokens", []):
        ids[a["id"]] = a["content"]
    if max(ids) >= vocab_size:
        raise GGUFError(f"tokenizer has id {max(ids)} but the model's vocab_size is {vocab_size}")
    tokens = [ids.get(i, f"[PAD{i}]") for i in range(vocab_size)]
    types = [TOKEN_TYPE_CONTROL if i in special else TOKEN_TYPE_NORMAL if i in ids
             else TOKEN_TYPE_UNUSED for i in range(vocab_size)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return tokens, types, merges


def _adds_bos(tokenizer: Tokenizer) -> bool:
    return tokenizer.bos_token_id is not None and \
        tokenizer.encode("a")[:1] == [tokenizer.bos_token_id]


def _write_metadata(w, model: LlamaForCausalLM, tokenizer: Tokenizer | None, file_type: str,
                    name: str) -> None:
    cfg = model.config
    w.add_name(name)
    w.add_file_type(FILE_TYPE_IDS[file_type])
    if file_type not in ("f32", "f16"):
        w.add_quantization_version(2)  # GGML_QNT_VERSION
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if tokenizer is None:
        w.add_tokenizer_model("none")
        return
    tokens, types, merges = _vocab(tokenizer, cfg.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    if tokenizer.bos_token_id is not None:
        w.add_bos_token_id(tokenizer.bos_token_id)
    if tokenizer.eos_token_id is not None:
        w.add_eos_token_id(tokenizer.eos_token_id)
        w.add_pad_token_id(tokenizer.eos_token_id)
    w.add_add_bos_token(_adds_bos(tokenizer))
    w.add_add_eos_token(False)


def export_gguf(model_or_name: LlamaForCausalLM | str | os.PathLike, path: str | os.PathLike,
                type: str = "f16", tokenizer: Tokenizer | None = None,
                progress: bool = True) -> dict[str, str]:
    """Write ``model_or_name`` (a labkit model, a shipped name or a HF folder) as GGUF.

    ``type`` is the file type: f32, f16, q8_0, q4_0 or q4_k_m (llama.cpp's mix). A name or
    folder brings its own tokenizer; a model object takes ``tokenizer`` (None writes a file with
    no vocabulary, which llama.cpp loads but cannot tokenize text for). Returns the GGML type
    chosen for each tensor.
    """
    from gguf import GGUFWriter

    if type not in FILE_TYPES:
        raise GGUFError(f"type must be one of {', '.join(FILE_TYPES)}, got {type!r}")
    name = "labkit-model"
    if isinstance(model_or_name, (str, os.PathLike)):
        from labkit.model.loader import load_pretrained

        name = Path(model_or_name).name
        model_or_name, tok = load_pretrained(model_or_name)
        tokenizer = tokenizer or tok
    model = model_or_name
    _check_exportable(model)
    cfg = model.config
    arch = GGUF_ARCH[cfg.architecture]
    writer = GGUFWriter(str(path), arch)
    _write_metadata(writer, model, tokenizer, type, name)
    chosen = {}
    with torch.no_grad():
        for tname, arr in tqdm(gguf_tensors(model), desc=f"gguf {type}", disable=not progress):
            qtype = tensor_type(tname, arr.shape, type, cfg.num_hidden_layers,
                                cfg.tie_word_embeddings)
            data = encode_tensor(arr, qtype)
            raw = None if qtype in ("f32", "f16") else ggml_type(qtype)
            writer.add_tensor(tname, data, raw_dtype=raw)
            chosen[tname] = qtype
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=False)
    writer.close()
    return chosen

"""Write a trained model in Hugging Face layout, so labkit and transformers both load it.

    config.json             ModelConfig.to_hf_dict(): architectures ["LlamaForCausalLM"], model_type
                            "llama", plus the dtype the weights are stored in
    generation_config.json  bos/eos/pad ids, so transformers' generate stops where labkit's does
    model.safetensors       float16 weights under Hugging Face's parameter names; with tied
                            embeddings `lm_head.weight` is omitted (it *is* the embedding)
    tokenizer.json, tokenizer_config.json

float16 halves the size of the shipped files; a model this small trains with weights well inside
float16's range (checked below: a non-finite weight after the cast is an error, not a warning).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from labkit.model.config import ModelConfig
from labkit.model.llama import LlamaForCausalLM
from labkit.model.moe import checkpoint_state_dict
from labkit.train.tokenizer import tokenizer_config

_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


def save_weights(model: LlamaForCausalLM, config: ModelConfig, out_dir: str | Path,
                 dtype: torch.dtype = torch.float16) -> Path:
    """``model.safetensors`` + ``config.json`` only: enough for transformers'
    ``from_pretrained`` when no tokenizer is needed (token-id prompts)."""
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"dtype must be one of {list(_DTYPE_NAMES.values())}, got {dtype}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # an MoE's stacked experts are written per expert, under save_pretrained's names
    state = {k: v.detach().to("cpu", dtype).contiguous()
             for k, v in checkpoint_state_dict(model).items()}
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    bad = [k for k, v in state.items() if not torch.isfinite(v).all()]
    if bad:
        raise ValueError(f"weights not finite after casting to {dtype}: {bad[:3]}")
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    hf = config.to_hf_dict()
    hf["torch_dtype"] = hf["dtype"] = _DTYPE_NAMES[dtype]
    (out / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    return out


def export_hf(model: LlamaForCausalLM, config: ModelConfig, tokenizer_dir: str | Path,
              out_dir: str | Path, dtype: torch.dtype = torch.float16) -> Path:
    """Save `model` + the tokenizer files from `tokenizer_dir` into `out_dir`; returns out_dir."""
    out = save_weights(model, config, out_dir, dtype)
    gen = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id,
           "pad_token_id": config.eos_token_ids[0] if config.eos_token_ids else None}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    src = Path(tokenizer_dir) / "tokenizer.json"
    if not src.is_file():
        raise ValueError(f"{src} is missing; the exported model needs its tokenizer")
    shutil.copyfile(src, out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(config.max_position_embeddings), indent=2) + "\n")
    return out

"""Save and load quantized checkpoints in the layouts AutoGPTQ/GPTQModel and AutoAWQ write.

A folder holds ``config.json`` (the model config plus a ``quantization_config``),
``model.safetensors`` (per quantized linear ``qweight``/``qzeros``/``scales`` [+ ``g_idx`` for
GPTQ]; everything else — embeddings, norms, lm_head — in fp16) and the tokenizer files. That is
what ``transformers`` + ``gptqmodel`` load (tests/quant/test_interop.py), and loading it back
here gives labkit quantized modules that plug into the model and the engine.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from labkit.quant.errors import CheckpointMismatchError, QuantizationError
from labkit.quant.linear import AWQLinear, GPTQLinear
from labkit.quant.model import set_module

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "generation_config.json")


def quantization_config(model: nn.Module) -> dict:
    """The ``quantization_config`` describing the model's quantized linears (all one format)."""
    qmods = [m for m in model.modules() if isinstance(m, (GPTQLinear, AWQLinear))]
    if not qmods:
        raise QuantizationError("model has no GPTQLinear/AWQLinear layers to save; quantize "
                                "it with gptq_quantize_model, awq_quantize_model or "
                                "quantize_model(..., 'int4_rtn') first")
    kinds = {(type(m), m.bits, m.group_size) for m in qmods}
    if len(kinds) > 1:
        raise QuantizationError(f"model mixes quantized layer kinds {kinds}; a checkpoint "
                                "holds one format")
    kind, bits, gs = kinds.pop()
    if kind is AWQLinear:
        return {"quant_method": "awq", "bits": bits, "group_size": gs, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": None}
    desc_act = any(not torch.equal(m.g_idx.long().cpu(),
                                   torch.arange(m.in_features) // gs) for m in qmods)
    mid = (2**bits) // 2
    sym = all(bool((m.qzeros == _packed_const(mid - 1, bits)).all()) for m in qmods)
    return {"quant_method": "gptq", "bits": bits, "group_size": gs, "desc_act": desc_act,
            "sym": sym, "true_sequential": True, "static_groups": False, "damp_percent": 0.01,
            "checkpoint_format": "gptq", "pack_dtype": "int32", "lm_head": False,
            "meta": {"quantizer": ["labkit:0.1.0"]}}


def _packed_const(v: int, bits: int) -> int:
    word = 0
    for j in range(32 // bits):
        word |= v << (bits * j)
    return word - 2**32 if word >= 2**31 else word


def save_quantized(model: nn.Module, out_dir: str | Path, tokenizer_dir: str | Path | None = None,
                   dtype: torch.dtype = torch.float16) -> Path:
    """Write config.json + model.safetensors (+ tokenizer files copied from tokenizer_dir)."""
    qc = quantization_config(model)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for name, t in model.state_dict().items():
        # lm_head is written even when tied to the embedding: AutoGPTQ loads into empty
        # tensors and never re-ties, so a missing lm_head would be uninitialised memory there.
        if t.is_floating_point() and not name.endswith("scales"):
            t = t.to(dtype)
        tensors[name] = t.detach().cpu().contiguous().clone()
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_hf_dict()
    cfg.update({"quantization_config": qc, "dtype": str(dtype).removeprefix("torch.")})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    if qc["quant_method"] == "gptq":
        # AutoGPTQ (archived) reads its settings from this file rather than config.json
        (out / "quantize_config.json").write_text(json.dumps(
            {k: qc[k] for k in ("bits", "group_size", "desc_act", "sym", "true_sequential",
                                "static_groups", "damp_percent")}
            | {"model_file_base_name": "model"}, indent=2) + "\n")
    if tokenizer_dir is not None:
        for f in TOKENIZER_FILES:
            if (Path(tokenizer_dir) / f).is_file():
                shutil.copy(Path(tokenizer_dir) / f, out / f)
    return out


def _check_config(qc: dict) -> None:
    method = qc.get("quant_method")
    if method not in ("gptq", "awq"):
        raise CheckpointMismatchError(f"quant_method {method!r} is not supported; labkit loads "
                                      "'gptq' and 'awq'")
    if method == "gptq" and qc.get("checkpoint_format", "gptq") != "gptq":
        raise CheckpointMismatchError(f"checkpoint_format {qc['checkpoint_format']!r}: only the "
                                      "'gptq' (v1, zero-1) layout is supported")
    if method == "awq" and str(qc.get("version", "gemm")).lower() != "gemm":
        raise CheckpointMismatchError(f"AWQ version {qc['version']!r}: only 'gemm' is supported")
    if qc.get("bits") not in ((2, 4, 8) if method == "gptq" else (4,)):
        raise CheckpointMismatchError(f"bits={qc.get('bits')!r} is not supported for {method}")


def _build_layer(qc: dict, prefix: str, t: dict, lin: nn.Linear) -> nn.Module:
    bits, gs = qc["bits"], qc["group_size"]
    K, N = lin.in_features, lin.out_features
    gs_eff = K if gs == -1 else gs
    if K % gs_eff:
        raise CheckpointMismatchError(f"{prefix}: in_features {K} not divisible by group_size "
                                      f"{gs} from quantization_config")
    G = K // gs_eff
    if qc["quant_method"] == "gptq":
        expect = {"qweight": (K * bits // 32, N), "qzeros": (G, N * bits // 32),
                  "scales": (G, N), "g_idx": (K,)}
    else:
        expect = {"qweight": (K, N // 8), "qzeros": (G, N // 8), "scales": (G, N)}
    for k, shape in expect.items():
        if k not in t:
            raise CheckpointMismatchError(f"{prefix}.{k} is missing from the checkpoint")
        if tuple(t[k].shape) != shape:
            raise CheckpointMismatchError(
                f"{prefix}.{k} has shape {tuple(t[k].shape)} but quantization_config "
                f"(bits={bits}, group_size={gs}) and the layer [{N}x{K}] imply {shape}")
    bias = t.get("bias")
    if qc["quant_method"] == "gptq":
        if int(t["g_idx"].max()) >= G or int(t["g_idx"].min()) < 0:
            raise CheckpointMismatchError(f"{prefix}.g_idx points outside the {G} groups")
        return GPTQLinear(t["qweight"], t["qzeros"], t["scales"], t["g_idx"], bits, gs_eff,
                          bias)
    return AWQLinear(t["qweight"], t["qzeros"], t["scales"], gs_eff, bias)


def load_quantized(path: str | Path, device: torch.device | str = "cpu",
                   dtype: torch.dtype = torch.float32) -> nn.Module:
    """A labkit model with GPTQLinear/AWQLinear layers from a GPTQ or AWQ (GEMM) folder."""
    from labkit.model.config import ModelConfig
    from labkit.model.llama import LlamaForCausalLM
    from labkit.model.moe import refuse_moe

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    qc = cfg.pop("quantization_config", None)
    if not qc:
        raise CheckpointMismatchError(f"{path}/config.json has no quantization_config; load a "
                                      "full-precision model with labkit.model.load_pretrained")
    _check_config(qc)
    config = ModelConfig.from_hf_dict(cfg)
    refuse_moe(config, "quantized checkpoints (load_quantized)")
    model = LlamaForCausalLM(config).to(dtype)
    with safe_open(str(path / "model.safetensors"), framework="pt") as st:
        tensors = {k: st.get_tensor(k) for k in st.keys()}
    prefixes = sorted(k.removesuffix(".qweight") for k in tensors if k.endswith(".qweight"))
    if not prefixes:
        raise CheckpointMismatchError(f"{path}: quantization_config says {qc['quant_method']} "
                                      "but model.safetensors has no .qweight tensors")
    for prefix in prefixes:
        lin = model.get_submodule(prefix)
        if not isinstance(lin, nn.Linear):
            raise CheckpointMismatchError(f"{prefix} is not a linear layer of this model")
        sub = {k.removeprefix(prefix + "."): tensors.pop(k)
               for k in [k for k in tensors if k.startswith(prefix + ".")]}
        set_module(model, prefix, _build_layer(qc, prefix, sub, lin))
    expected = model.state_dict()
    unexpected = [k for k in tensors if k not in expected]
    if unexpected:
        raise CheckpointMismatchError(f"unexpected tensors {unexpected[:3]}: config.json does "
                                      "not describe this checkpoint")
    missing = [k for k in expected if k not in tensors and not k.endswith(
        (".qweight", ".qzeros", ".scales", ".g_idx")) and not (
        k.endswith(".bias") and any(k.startswith(p + ".") for p in prefixes))]
    if model.config.tie_word_embeddings and "lm_head.weight" in missing:
        missing.remove("lm_head.weight")
    if missing:
        raise CheckpointMismatchError(f"checkpoint lacks {len(missing)} tensors, e.g. "
                                      f"{missing[:3]}")
    with torch.no_grad():
        for k, t in tensors.items():
            expected[k].copy_(t.to(expected[k].dtype))
    return model.to(device).eval()

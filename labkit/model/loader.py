"""Loading Hugging Face checkpoints (config.json + safetensors + tokenizer.json) into labkit.

Works offline from a local folder, with single-file or sharded safetensors
(``model.safetensors.index.json``). The lab's own models ship under ``datasets/models/<name>``
and resolve by name. Every mismatch between the config and the tensors is reported by name:
a silently half-loaded model is the worst bug a learner can meet.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from labkit.errors import CheckpointError
from labkit.model.config import ConfigError, ModelConfig
from labkit.model.llama import LlamaForCausalLM, causal_lm_class
from labkit.model.meta import empty_model, materialize
from labkit.model.tokenizer import Tokenizer
from labkit.paths import DATASETS_DIR

SHIPPED_MODELS = ("labkit-tiny", "labkit-tiny-draft", "labkit-tiny-moe")


def models_dir() -> Path:
    """Where shipped models live: $LABKIT_MODELS_DIR or <repo>/datasets/models."""
    return Path(os.environ.get("LABKIT_MODELS_DIR", DATASETS_DIR / "models"))


def available_models() -> list[str]:
    d = models_dir()
    return sorted(p.name for p in d.iterdir() if (p / "config.json").is_file()) if d.is_dir() \
        else []


def resolve_model_path(path_or_name: str | os.PathLike) -> Path:
    """A local folder, the name of a shipped model, or ``s3://bucket/prefix`` (fetched into the
    node-local cache by :mod:`labkit.model.objstore`). Hub ids cannot be fetched here."""
    if str(path_or_name).startswith("s3://"):
        from labkit.model.objstore import fetch_checkpoint

        return fetch_checkpoint(str(path_or_name))
    p = Path(path_or_name).expanduser()
    if p.is_dir():
        return p
    shipped = models_dir() / str(path_or_name)
    if (shipped / "config.json").is_file():
        return shipped
    if str(path_or_name) in SHIPPED_MODELS:
        raise CheckpointError(f"shipped model {path_or_name!r} is not in {models_dir()}; "
                              "run `labkit train` to build it")
    if re.fullmatch(r"[A-Za-z0-9_.-]+/[A-Za-z0-9_.-]+", str(path_or_name)) and not p.exists():
        raise CheckpointError(
            f"{path_or_name!r} looks like a Hugging Face Hub id, and labkit never downloads at "
            "run time. Download the checkpoint yourself (e.g. `huggingface-cli download "
            f"{path_or_name} --local-dir ./ckpt`) and pass its folder path.")
    raise CheckpointError(f"no model folder at {str(path_or_name)!r}; shipped models: "
                          f"{', '.join(available_models()) or '(none)'}")


def load_config(path: Path) -> ModelConfig:
    f = path / "config.json"
    if not f.is_file():
        raise CheckpointError(f"{path} has no config.json")
    try:
        d = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{f} is not valid JSON: {e}") from e
    if d.get("quantization_config"):
        raise CheckpointError(f"{f} describes a quantized checkpoint "
                              f"({d['quantization_config'].get('quant_method', '?')}); load it "
                              "with labkit.quant instead")
    try:
        return ModelConfig.from_hf_dict(d)
    except ConfigError as e:
        raise ConfigError(f"{f}: {e}") from e


def _damaged(f: Path, problem: str) -> CheckpointError:
    """The error for a file that exists but cannot be read, with what to do about it."""
    head = f.read_bytes()[:64] if f.is_file() else b""
    if head.startswith(b"version https://git-lfs"):
        fix = "it is a Git LFS pointer, not the file itself: run `git lfs pull`"
    elif f.parent.parent == models_dir() and f.parent.name in SHIPPED_MODELS:
        fix = (f"restore it (`git checkout -- {f.name}` in {f.parent}) or rebuild it with "
               "`labkit train`")
    else:
        fix = ("copy or download it again, or re-save the checkpoint "
               "(save_pretrained, or labkit.train.export.export_hf)")
    return CheckpointError(f"{f} is truncated or corrupt ({problem}); {fix}")


def _weight_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text()).get("weight_map", {})
        except (json.JSONDecodeError, AttributeError) as e:
            raise _damaged(index, f"not a JSON object with a weight_map: {e}") from e
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"shards named in {index.name} are missing: {missing}")
        return files
    single = path / "model.safetensors"
    if single.is_file():
        return [single]
    raise CheckpointError(f"{path} has neither model.safetensors nor "
                          "model.safetensors.index.json (only safetensors is supported)")


def _copy_tensors(f: Path, params: dict[str, torch.Tensor], tied: bool,
                  seen: set[str]) -> None:
    """Copy one safetensors file's tensors into ``params``, checking names and shapes."""
    with safe_open(str(f), framework="pt") as st:
        for name in st.keys():
            if name.endswith("rotary_emb.inv_freq"):
                continue  # some exporters save this buffer; labkit recomputes it
            if name not in params:
                if name == "lm_head.weight" and tied:
                    continue
                raise CheckpointError(f"{f.name}: unexpected tensor {name!r} (does "
                                      "config.json match this checkpoint?)")
            t = st.get_tensor(name)
            if t.shape != params[name].shape:
                raise CheckpointError(f"{f.name}: tensor {name!r} has shape "
                                      f"{tuple(t.shape)} but config.json implies "
                                      f"{tuple(params[name].shape)}")
            with torch.no_grad():
                params[name].copy_(t)
            seen.add(name)


def _checkpoint_views(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor],
                                                       dict[str, list[str]]]:
    """On-disk names that are slices of a parameter (an MoE layer's per-expert tensors, stacked
    in memory: :meth:`labkit.model.moe.SparseMoeBlock.checkpoint_tensors`): name -> view, and
    parameter -> the on-disk names that fill it."""
    views: dict[str, torch.Tensor] = {}
    parts: dict[str, list[str]] = {}
    for prefix, module in model.named_modules():
        if hasattr(module, "checkpoint_tensors"):
            for disk, (param, view) in module.checkpoint_tensors(prefix).items():
                views[disk] = view
                parts.setdefault(param, []).append(disk)
    return views, parts


def load_weights(model: LlamaForCausalLM, path: Path) -> None:
    """Copy every tensor into the model, checking names and shapes against the config.

    A parameter loads from its own name, or from the on-disk tensors that are its slices."""
    params = dict(model.named_parameters())
    views, parts = _checkpoint_views(model)
    seen: set[str] = set()
    for f in _weight_files(path):
        try:
            _copy_tensors(f, {**params, **views}, model.config.tie_word_embeddings, seen)
        except SafetensorError as e:  # a header or a tensor cut short, or garbage
            raise _damaged(f, f"safetensors: {e}") from e
    seen |= {p for p, disk in parts.items() if all(d in seen for d in disk)}
    missing = [d for n in params if n not in seen
               and not (n == "lm_head.weight" and model.config.tie_word_embeddings)
               for d in ([x for x in parts[n] if x not in seen] if n in parts else [n])]
    if missing:
        raise CheckpointError(f"checkpoint is missing {len(missing)} tensor(s), e.g. "
                              f"{missing[:3]}")


def load_model(path_or_name: str | os.PathLike, dtype: torch.dtype | str | None = None,
               device: torch.device | str | None = None) -> LlamaForCausalLM:
    path = resolve_model_path(path_or_name)
    config = load_config(path)
    if isinstance(dtype, str):
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {dtype!r}")
        dtype = getattr(torch, dtype)
    dtype = dtype or torch.float32
    with empty_model():
        model = causal_lm_class(config)(config)
    model = materialize(model, device or "cpu").to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    load_weights(model, path)
    return model.eval()


@dataclass
class CheckpointHandle:
    """A checkpoint the driver does not load: with tensor parallelism each worker process reads
    only its own slices from ``folder``. Has the three attributes an engine reads of a model."""

    config: ModelConfig
    folder: Path
    dtype: torch.dtype = torch.float32
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))


def has_tokenizer(path_or_name: str | os.PathLike) -> bool:
    """Whether a checkpoint folder carries a tokenizer (``tokenizer.json``). A folder written by
    transformers' ``model.save_pretrained`` alone has none: such a model still runs on token
    ids (vLLM's ``skip_tokenizer_init``), which is how :class:`labkit.LLM` loads it."""
    if str(path_or_name).endswith(".gguf"):
        return True
    return (resolve_model_path(path_or_name) / "tokenizer.json").is_file()


def open_checkpoint(path_or_name: str | os.PathLike, dtype: torch.dtype | None = None,
                    device: torch.device | str | None = None, skip_tokenizer_init: bool = False
                    ) -> tuple[CheckpointHandle, Tokenizer | None]:
    """Config and tokenizer of a checkpoint, and a handle to its weights (not read here);
    ``device`` is where the ranks will put them (cpu: gloo, cuda: NCCL)."""
    path = resolve_model_path(path_or_name)
    config = load_config(path)
    _weight_files(path)  # fail now if there are none
    eos = config.eos_token_ids
    tok = None if skip_tokenizer_init else Tokenizer.from_dir(path, config.bos_token_id,
                                                              eos[0] if eos else None)
    return CheckpointHandle(config, path, dtype or torch.float32,
                            torch.device(device or "cpu")), tok


def load_pretrained(path_or_name: str | os.PathLike, dtype: torch.dtype | str | None = None,
                    device: torch.device | str | None = None, skip_tokenizer_init: bool = False
                    ) -> tuple[LlamaForCausalLM, Tokenizer | None]:
    """(model, tokenizer) from a local Hugging Face folder or a shipped model's name.

    dtype defaults to float32 (exact comparisons on CPU); device defaults to CPU. A path
    ending in ``.gguf`` is read through a memory map by :mod:`labkit.model.gguf_loader`. A
    missing tokenizer is an error unless ``skip_tokenizer_init`` (then the tokenizer is None).
    """
    if str(path_or_name).endswith(".gguf"):
        from labkit.model.gguf_loader import load_gguf

        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        return load_gguf(path_or_name, dtype, device)
    model = load_model(path_or_name, dtype, device)
    if skip_tokenizer_init:
        return model, None
    path = resolve_model_path(path_or_name)
    eos = model.config.eos_token_ids
    try:
        tok = Tokenizer.from_dir(path, model.config.bos_token_id, eos[0] if eos else None)
    except FileNotFoundError as e:
        raise CheckpointError(str(e)) from e
    except json.JSONDecodeError as e:
        raise _damaged(path / "tokenizer_config.json", f"not valid JSON: {e}") from e
    except Exception as e:  # the tokenizers library raises plain Exceptions on a bad file
        raise _damaged(path / "tokenizer.json", f"tokenizers: {e}") from e
    return model, tok

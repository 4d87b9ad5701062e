"""Loading a LoRA adapter in PEFT's format, checked against the model it will run on.

A PEFT adapter folder (``peft``'s ``save_pretrained``) holds two files:

- ``adapter_config.json``: ``peft_type: "LORA"``, ``r``, ``lora_alpha``, ``target_modules``
  (names such as ``["q_proj", "v_proj"]``, a regex string, or ``"all-linear"``),
  ``use_rslora``, and options labkit does not serve (DoRA, per-module rank/alpha patterns,
  trained biases, ``modules_to_save``), which are refused by name rather than ignored;
- ``adapter_model.safetensors``: per targeted linear ``W`` (``out x in``) two matrices,
  ``...<module>.lora_A.weight`` (``r x in``) and ``...<module>.lora_B.weight`` (``out x r``),
  under the names of the wrapped model (``base_model.model.`` + the HF module path).

The adapted layer computes ``W x + scaling * B (A x)`` with ``scaling = lora_alpha / r``, or
``lora_alpha / sqrt(r)`` for rsLoRA (which keeps the update's size stable as r grows).

Every check happens here, once, when a request first names the adapter, so a bad adapter is an
``add_request`` error (:class:`~labkit.errors.LoRAError`), never a failed step: a rank above
``max_lora_rank`` (the slots are that wide), a target module the model lacks, a matrix whose
shape does not match the base layer (an adapter trained for another model).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from labkit.errors import LoRAError

#: the projections an adapter may target (HF's names, which labkit's model keeps)
SUPPORTED_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                     "down_proj")
_PREFIX = "base_model.model."
_KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")


@dataclass
class LoRAModel:
    """One loaded adapter on CPU: ``weights[module path] = (A [r, in], B [out, r])``."""

    lora_int_id: int
    rank: int
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]


def read_adapter_config(path: Path) -> dict:
    """``adapter_config.json`` as a dict, refusing what is not a plain LoRA adapter."""
    f = path / "adapter_config.json"
    if not f.is_file() or not (path / "adapter_model.safetensors").is_file():
        raise LoRAError(f"{path} is not a PEFT adapter folder (needs adapter_config.json and "
                        "adapter_model.safetensors, as peft's save_pretrained writes)")
    cfg = json.loads(f.read_text())
    if cfg.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"{path}: peft_type {cfg.get('peft_type')!r}; only LoRA is served")
    refused = {"use_dora": bool(cfg.get("use_dora")), "rank_pattern": bool(cfg.get("rank_pattern")),
               "alpha_pattern": bool(cfg.get("alpha_pattern")),
               "modules_to_save": bool(cfg.get("modules_to_save")),
               "bias": cfg.get("bias", "none") != "none",
               "fan_in_fan_out": bool(cfg.get("fan_in_fan_out"))}
    bad = sorted(k for k, v in refused.items() if v)
    if bad:
        raise LoRAError(f"{path}: adapter options {bad} are not served by labkit (plain LoRA "
                        "on q/k/v/o/gate/up/down only)")
    for k in ("r", "lora_alpha"):
        if not isinstance(cfg.get(k), (int, float)) or cfg[k] <= 0:
            raise LoRAError(f"{path}: adapter_config.json needs a positive {k}, got "
                            f"{cfg.get(k)!r}")
    return cfg


def lora_scaling(cfg: dict) -> float:
    """``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora`` (PEFT's rule)."""
    r, alpha = cfg["r"], cfg["lora_alpha"]
    return alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r


def check_targets(cfg: dict, targets: dict[str, tuple[int, int]], path: Path) -> None:
    """Every module name the config targets must exist in the model as a served projection."""
    tm = cfg.get("target_modules")
    if tm is None or tm == "all-linear":
        return
    have = {name.rsplit(".", 1)[-1] for name in targets}
    if isinstance(tm, str):  # a regex over full module names, as peft matches it
        if not any(re.fullmatch(tm, name) for name in targets):
            raise LoRAError(f"{path}: target_modules regex {tm!r} matches no projection of "
                            f"the model ({sorted(have)})")
        return
    missing = sorted(set(tm) - have)
    if missing:
        raise LoRAError(f"{path}: targets {missing}, which the model lacks (LoRA layers: "
                        f"{sorted(have)}; labkit serves {list(SUPPORTED_MODULES)})")


def load_adapter(lora_int_id: int, path: str | Path, targets: dict[str, tuple[int, int]],
                 max_lora_rank: int) -> LoRAModel:
    """Load and check a PEFT adapter for a model whose LoRA-capable linears are ``targets``
    (module path -> ``(in_features, out_features)``); tensors stay on CPU in float32."""
    path = Path(path)
    cfg = read_adapter_config(path)
    check_targets(cfg, targets, path)
    tensors = load_file(str(path / "adapter_model.safetensors"))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key.removeprefix(_PREFIX))
        if m is None:
            raise LoRAError(f"{path}: unexpected tensor {key!r} (only lora_A / lora_B weights "
                            "of linear layers are served)")
        pairs.setdefault(m["module"], {})[m["which"]] = t.float()
    weights = {name: _checked_pair(name, ab, targets, path) for name, ab in pairs.items()}
    ranks = {a.shape[0] for a, _ in weights.values()}
    if not weights:
        raise LoRAError(f"{path}: the adapter holds no LoRA weights")
    rank = max(ranks)
    if rank > max_lora_rank:
        raise LoRAError(f"{path}: LoRA rank {rank} exceeds max_lora_rank={max_lora_rank}; "
                        "raise max_lora_rank (the slots are allocated at that rank)")
    return LoRAModel(lora_int_id, rank, lora_scaling(cfg), weights)


def _checked_pair(name: str, ab: dict[str, torch.Tensor], targets: dict[str, tuple[int, int]],
                  path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    if name not in targets:
        raise LoRAError(f"{path}: adapter weights for {name!r}, a module the model lacks (an "
                        "adapter for another architecture or depth?)")
    if set(ab) != {"A", "B"}:
        raise LoRAError(f"{path}: {name} has lora_{''.join(ab)} but not both lora_A and lora_B")
    a, b = ab["A"], ab["B"]
    n_in, n_out = targets[name]
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != n_in or b.shape[0] != n_out \
            or b.shape[1] != a.shape[0]:
        raise LoRAError(f"{path}: {name} has lora_A {tuple(a.shape)} and lora_B "
                        f"{tuple(b.shape)}, but the base layer is {n_out} x {n_in} (needs "
                        f"A [r, {n_in}] and B [{n_out}, r]): an adapter for another model")
    return a, b

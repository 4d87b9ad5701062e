"""Writing a LoRA adapter in PEFT's format, without ``peft`` (the inverse of ``adapter.py``).

``peft``'s ``save_pretrained`` is the reference writer; this one exists so a machine without
``peft`` can still make adapters for a benchmark or a notebook, and it writes exactly what
:func:`~labkit.lora.adapter.load_adapter` and ``peft.PeftModel.from_pretrained`` read:
``adapter_config.json`` (``peft_type``, ``r``, ``lora_alpha``, ``target_modules``, the base
model's folder) and ``adapter_model.safetensors`` with ``base_model.model.<module>.lora_A.weight``
[r, in] and ``.lora_B.weight`` [out, r] for every targeted projection.

:func:`random_adapter` draws both factors from a seeded generator: A as peft's Kaiming-uniform
init, and B non-zero (peft's fresh B is zero, an adapter that changes nothing), so a benchmark's
adapters really cost and really change the output.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import save_file

from labkit.errors import LoRAError
from labkit.lora.adapter import SUPPORTED_MODULES


def save_peft_adapter(path: str | Path, weights: dict[str, tuple[torch.Tensor, torch.Tensor]],
                      r: int, lora_alpha: float, base_model: str | Path | None = None) -> Path:
    """Write ``weights[module path] = (A [r, in], B [out, r])`` as a PEFT adapter folder."""
    path = Path(path)
    targets = sorted({name.rsplit(".", 1)[-1] for name in weights})
    bad = sorted(set(targets) - set(SUPPORTED_MODULES))
    if bad or not weights:
        raise LoRAError(f"cannot write adapter: targets {bad or 'none'} (labkit serves "
                        f"{list(SUPPORTED_MODULES)})")
    tensors = {}
    for name, (a, b) in weights.items():
        if a.shape[0] != r or b.shape[1] != r:
            raise LoRAError(f"{name}: A {tuple(a.shape)} / B {tuple(b.shape)} are not rank {r}")
        tensors[f"base_model.model.{name}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.contiguous()
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": lora_alpha,
           "lora_dropout": 0.0, "target_modules": targets, "bias": "none",
           "use_rslora": False, "use_dora": False, "fan_in_fan_out": False,
           "base_model_name_or_path": None if base_model is None else str(base_model)}
    (path / "adapter_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return path


def random_adapter(model: torch.nn.Module, path: str | Path, targets: list[str], r: int = 8,
                   lora_alpha: float = 16, seed: int = 0, b_std: float = 0.05,
                   base_model: str | Path | None = None) -> Path:
    """A seeded random adapter on every ``targets`` projection of ``model`` (HF module names,
    which labkit's model keeps), written by :func:`save_peft_adapter`."""
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for name, m in model.named_modules():
        if name.rsplit(".", 1)[-1] in targets and hasattr(m, "in_features"):
            bound = 1 / math.sqrt(m.in_features)  # kaiming_uniform(a=sqrt(5)), as peft's A
            a = (torch.rand(r, m.in_features, generator=g) * 2 - 1) * bound
            b = torch.randn(m.out_features, r, generator=g) * b_std
            weights[name] = (a, b)
    return save_peft_adapter(path, weights, r, lora_alpha, base_model)

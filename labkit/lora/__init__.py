"""Multi-LoRA serving: many adapters in PEFT's format, mixed in one batch (vLLM's ``vllm.lora``).

    llm = labkit.LLM(model=folder, enable_lora=True, max_loras=2, max_lora_rank=16)
    llm.generate(prompts, sp, lora_request=[LoRARequest("sql", 1, sql_dir), None, ...])

The pieces, one module each: ``request`` (:class:`LoRARequest`), ``adapter`` (load and check a
PEFT folder), ``ops`` (the batched shrink / expand delta), ``layers`` (the post-load transform:
:class:`LoRALinear` slots and the shared per-step :class:`LoRAContext`), ``manager`` (device
slots and the CPU cache, both LRU), ``punica`` (the per-forward plan the layers' deltas run
through: PyTorch, or the Triton kernels of ``kernels/lora_ops.py`` with the Triton backend),
``writer`` (PEFT-format adapters without peft) and ``executor`` (the engine plug-in and the
scheduler's admission rule). The engine meets it only at seams: ``Executor.add_lora`` /
``admission_policy``, ``ModelRunner.step_hooks``, the request's ``lora_request`` data and the
prefix-cache key.
"""

from labkit.lora.adapter import LoRAModel, load_adapter
from labkit.lora.layers import LoRAContext, LoRALinear, apply_lora
from labkit.lora.manager import LoRAManager
from labkit.lora.ops import bgmv_expand, bgmv_shrink
from labkit.lora.request import LoRARequest

__all__ = ["LoRAContext", "LoRALinear", "LoRAManager", "LoRAModel", "LoRARequest", "apply_lora",
           "bgmv_expand", "bgmv_shrink", "load_adapter"]

"""labkit: learn how LLM inference gets fast by running and breaking real code.

The public API is small and named after vLLM's so what you learn here transfers:

    import labkit
    model, tokenizer = labkit.load_pretrained("labkit-tiny")
    llm = labkit.LLM(model="labkit-tiny")
    outs = llm.generate(["def fibonacci(n):"], labkit.SamplingParams(max_tokens=32))

Heavy submodules are imported lazily so `import labkit` stays fast.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "load_pretrained": "labkit.model.loader",
    "ModelConfig": "labkit.model.config",
    "LlamaForCausalLM": "labkit.model.llama",
    "generate": "labkit.model.generate",
    "LLM": "labkit.engine.llm",
    "LLMEngine": "labkit.engine.llm_engine",
    "SamplingParams": "labkit.engine.sampling_params",
    "StructuredOutputsParams": "labkit.engine.sampling_params",
    "Logprob": "labkit.engine.outputs",
    "SamplingParamsError": "labkit.errors",
    "InvalidPromptError": "labkit.errors",
    "EngineConfigError": "labkit.errors",
    "EngineStepError": "labkit.errors",
    "LoRAError": "labkit.errors",
    "LoRARequest": "labkit.lora.request",
    "StructuredOutputsError": "labkit.errors",
    "export_gguf": "labkit.quant.gguf_export",
}

__all__ = ["__version__", *_LAZY]


def _register_plugins() -> None:
    """The composition root: pieces that live above (or beside) the layer that uses them are
    plugged in here, so no layer imports upward: the speculative and LoRA executors
    (``labkit.spec``, ``labkit.lora``) into the engine, the Triton attention backend
    (``labkit.kernels``) into ``labkit.kv``. Each factory imports its package only when it
    is first asked for."""
    from labkit.engine.executor import register_executor_factory
    from labkit.kv.backends import register_attention_backend

    def speculative(base: Any, config: Any) -> Any:
        from labkit.spec.executor import make_spec_executor

        return make_spec_executor(base, config)

    def tensor_parallel(model: Any, config: Any) -> Any:
        from labkit.parallel.executor import build_tp_executor

        return build_tp_executor(model, config)

    def lora(base: Any, config: Any) -> Any:
        from labkit.lora.executor import make_lora_executor

        return make_lora_executor(base, config)

    def triton() -> Any:
        from labkit.kernels.backend import TritonBackend

        return TritonBackend()

    register_executor_factory("speculative", speculative)
    register_executor_factory("tensor_parallel", tensor_parallel)
    register_executor_factory("lora", lora)
    register_attention_backend("triton", triton)


_register_plugins()


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")

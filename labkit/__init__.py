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
    "SamplingParamsError": "labkit.engine.errors",
    "InvalidPromptError": "labkit.engine.errors",
    "EngineConfigError": "labkit.engine.errors",
    "EngineStepError": "labkit.engine.errors",
    "export_gguf": "labkit.quant.gguf_export",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'labkit' has no attribute {name!r}")

"""labkit.spec: speculative decoding (draft model and n-gram drafts, exact rejection sampling).

``labkit.LLM(model=..., speculative_config={"method": "ngram" | "draft_model", ...})`` routes
through :func:`make_spec_executor`; the pieces are importable on their own for the notebooks.
"""

from labkit.spec.config import SpeculativeConfig, SpeculativeConfigError
from labkit.spec.executor import SpecDecodeExecutor, make_spec_executor

__all__ = ["SpecDecodeExecutor", "SpeculativeConfig", "SpeculativeConfigError",
           "make_spec_executor"]

"""labkit.spec: speculative decoding (draft model, EAGLE head and n-gram drafts, exact rejection
sampling).

Sits above the engine: ``SpecDecodeExecutor`` implements the engine's executor contract around
its ``ModelRunner``, and the draft model runs through a ModelRunner of its own.
``labkit.LLM(model=..., speculative_config={"method": "ngram" | "draft_model" | "eagle", ...})``
builds it through :func:`make_spec_executor` (registered by ``labkit/__init__``); the pieces are
importable on their own for the notebooks: ``rejection`` (the accept / resample rule),
``proposers``, ``eagle`` (the EAGLE head, its training and save/load) with ``eagle_proposer``,
``theory`` (formulas, acceptance statistics from a trace, and the engine-free reference
``speculative_generate``).
"""

from labkit.spec.config import SpeculativeConfig, SpeculativeConfigError
from labkit.spec.executor import SpecDecodeExecutor, make_spec_executor
from labkit.spec.proposers import DraftModelProposer, NgramProposer
from labkit.spec.rejection import rejection_sample, verify, verify_greedy
from labkit.spec.theory import (
    acceptance_stats,
    expected_speedup,
    expected_tokens_per_step,
    speculative_generate,
    trace_acceptance,
)

__all__ = ["DraftModelProposer", "NgramProposer", "SpecDecodeExecutor", "SpeculativeConfig",
           "SpeculativeConfigError", "acceptance_stats", "expected_speedup",
           "expected_tokens_per_step", "make_spec_executor", "rejection_sample",
           "speculative_generate", "trace_acceptance", "verify", "verify_greedy"]

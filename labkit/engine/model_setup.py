"""Preparing a model for an engine, before the engine exists: its speculative draft and how its
mixture-of-experts layers run. Kept out of :mod:`labkit.engine.llm_engine` so that module stays
the engine's loop and API."""

from __future__ import annotations

import torch

from labkit.config import EngineConfig


def moe_experts(model: torch.nn.Module, backend: str | None) -> None:
    """The experts' implementation follows the engine's kernel backend, as attention does: the
    grouped Triton kernel (``kernels/fused_moe.py``: tokens sorted by expert, one GEMM per
    projection over all experts) for "triton", the reference loop otherwise. Set on the model's
    MoE layers, so the last engine built on a model object decides for it."""
    from labkit.model.moe import use_fused_experts

    if backend == "triton":
        from labkit.kernels.fused_moe import fused_moe

        use_fused_experts(model, fused_moe)
    else:
        use_fused_experts(model, None)


def load_draft(config: EngineConfig, target: torch.nn.Module) -> None:
    """Load the speculative draft model (if any) and check it against the target, before the
    engine exists: a mismatch is a construction error, not a mid-generation one."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model":
        return
    draft = spec.model
    if not isinstance(draft, torch.nn.Module):
        from labkit.model.loader import load_model

        draft = load_model(draft, dtype=target.dtype, device=target.device)
    spec.check_draft(draft.config, target.config, config.max_model_len)
    spec.draft_model = draft.eval()

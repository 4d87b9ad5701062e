"""Preparing a model for an engine, before the engine exists: its speculative draft, how its
mixture-of-experts layers run, and the step cures of ``LLM(fused=True, compile=True)``. Kept out
of :mod:`labkit.engine.llm_engine` so that module stays the engine's loop and API."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch

from labkit.config import EngineConfig
from labkit.errors import EngineConfigError


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


COMPILE_MODES = ("full_and_piecewise", "piecewise")  # as vLLM's cudagraph_mode values


def step_cures(model: torch.nn.Module, settings: dict[str, Any], fused: bool, compile: bool,
               capture_sizes: tuple[int, ...] | None = None,
               compile_mode: str = "full_and_piecewise", compile_wrapper: str = "cpp",
               cuda_graphs: bool = True) -> Any:
    """Apply ``fused`` (:func:`labkit.model.fuse.fuse_model`: q|k|v and gate|up, the residual
    add in the norms, the rotary table) and ``compile`` (:func:`labkit.engine.piecewise.
    compile_model`) to the engine's model, in place; returns the compile report (None without
    ``compile``). ``compile_mode`` "full_and_piecewise" runs uniform decode steps as full
    graphs (:mod:`labkit.engine.full_graph`) and the others piecewise; "piecewise" runs every
    step piecewise. ``compile_wrapper`` "cpp" calls a full graph's kernels from generated C++,
    "python" from inductor's Python wrapper; ``cuda_graphs`` captures the full graphs as CUDA
    graphs on a CUDA device. Both change the model in this process, so
    workers that load their own slices (tensor parallelism) and LoRA's per-step adapter
    state are refused by name."""
    if compile_mode not in COMPILE_MODES:
        raise EngineConfigError(f"compile_mode must be one of {COMPILE_MODES}, got "
                                f"{compile_mode!r}")
    if not isinstance(cuda_graphs, bool):
        raise EngineConfigError(f"cuda_graphs must be True or False, got {cuda_graphs!r}")
    if not (fused or compile):
        return None
    check_step_cures(settings, fused, compile)
    if fused:
        from labkit.model.fuse import fuse_model

        fuse_model(model)
        norm_kernel(model, settings.get("attention_backend") == "triton")
    if not compile:
        return None
    from labkit.engine.piecewise import CAPTURE_SIZES, WRAPPERS, compile_model

    if compile_wrapper not in WRAPPERS:
        raise EngineConfigError(f"compile_wrapper must be one of {WRAPPERS}, got "
                                f"{compile_wrapper!r}")

    return compile_model(model, tuple(capture_sizes or CAPTURE_SIZES),
                         full_graphs=compile_mode == "full_and_piecewise",
                         wrapper=compile_wrapper, cuda_graphs=cuda_graphs)


def check_step_cures(settings: dict[str, Any], fused: bool, compile: bool) -> None:
    """Refuse, before a model is loaded or changed, cures the other settings cannot run with
    (``labkit serve --fused / --compile`` checks its flags with this at start)."""
    if not (fused or compile):
        return
    what = " and ".join(n for n, on in (("fused=True", fused), ("compile=True", compile)) if on)
    if (settings.get("tensor_parallel_size") or 1) != 1 or \
            settings.get("distributed_executor_backend") is not None:
        raise EngineConfigError(f"{what} transforms the model in this process; tensor-parallel "
                                "workers load and run their own slices unchanged")
    if compile and settings.get("enable_lora"):
        raise EngineConfigError("compile=True with enable_lora: the adapters' per-step token "
                                "mapping is state a compiled graph would guard on every step")


def _kernel_norm(kernel: Any, norm: torch.nn.Module, x: torch.Tensor,
                 residual: torch.Tensor | None = None) -> Any:
    return kernel(x, norm.weight, norm.eps, residual)


def norm_kernel(model: torch.nn.Module, on: bool) -> None:
    """The decoder's RMSNorms (``input_layernorm``, ``post_attention_layernorm``, the final
    norm) run ``kernels/rms_norm.py``'s one-pass add + norm when ``on`` (the "triton" kernel
    backend, as the MoE experts follow it), the PyTorch form otherwise: ``RMSNorm.forward``
    overridden on each instance, or the override removed."""
    norms = [n for la in model.model.layers
             for n in (la.input_layernorm, la.post_attention_layernorm)] + [model.model.norm]
    if not on:
        for n in norms:
            vars(n).pop("forward", None)
        return
    from labkit.kernels.rms_norm import rms_norm

    for n in norms:
        n.forward = partial(_kernel_norm, rms_norm, n)


def window_to_free(model_config: Any, config: EngineConfig) -> int | None:
    """The sliding window the block manager frees blocks outside of (labkit.kv.hybrid), or None.

    Only when every layer slides with one window (Mistral); not with speculative decoding (a
    draft model reads the same block tables with its own layers, which may attend fully, so a
    block dead for the target could still be read by the draft), nor with a KV connector (it
    saves, loads and ships a request's blocks by their ids, every one of them)."""
    from labkit.kv.hybrid import freeable_window

    if config.speculative is not None or config.kv_transfer is not None:
        return None
    return freeable_window(model_config)


def hybrid_kv_layout(model_config: Any, config: EngineConfig) -> Any:
    """The per-group layout (labkit.kv.hybrid.HybridLayout) when the engine gives each layer
    group its own block table (labkit.kv.hybrid_manager), or None: one table.

    For a model that mixes sliding and full layers, unless ``disable_hybrid_kv_cache_manager``;
    not with speculative decoding, a KV connector or tensor-parallel workers, which read one
    block table per sequence (they keep every block, as before)."""
    from labkit.kv.hybrid import hybrid_layout

    if config.cache.disable_hybrid_kv_cache_manager or config.speculative is not None \
            or config.kv_transfer is not None or config.parallel.uses_workers:
        return None
    return hybrid_layout(model_config)


def size_kv_pool(model_config: Any, config: EngineConfig, dtype: torch.dtype) -> Any:
    """Resolve the pool's ``num_blocks`` for the model's shapes (MLA layers: the latent) and
    return the hybrid layout (or None). With per-group tables a block id holds one group's
    layers, and every group needs tables of its own: the default pool covers max_num_seqs
    full-length sequences in every group (the same bytes as one table)."""
    from labkit.kv.cache import model_kv_bytes_per_block

    c, cache = model_config, config.cache
    layout = hybrid_kv_layout(c, config)
    per_block, groups = model_kv_bytes_per_block(c, cache.block_size, dtype,
                                                 cache.kv_cache_dtype), 1
    if layout is not None:
        per_block = per_block * layout.num_tensors // c.num_hidden_layers
        groups = len(layout.groups)
        cache.kv_group_windows = tuple(g.sliding_window for g in layout.groups)
    cache.resolve_num_blocks(per_block, config.scheduler.max_num_seqs * groups,
                             config.max_model_len)
    return layout

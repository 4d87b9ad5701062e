"""The layer layout: each decoder layer is built from its own spec, through two small registries.

Why per layer: the models of 2026 are not one layer repeated. Gemma 3 and gpt-oss mix sliding and
full attention, DeepSeek-V3 keeps its first layers dense and makes the rest mixture-of-experts,
Qwen2 slides only its upper layers. So the config answers, per layer, *what this layer is*
(:meth:`~labkit.model.config.ModelConfig.layer_spec` -> :class:`~labkit.model.config.LayerSpec`),
and this module turns the answer into modules:

    ModelConfig.layer_spec(i)  ─►  LayerSpec(attention="sliding", sliding_window=8, mlp="dense")
                                       │                                    │
    make_attention(config, i)  ◄───────┘ ATTENTION_LAYERS[spec.attention]   │
    make_mlp(config, i)        ◄─────────────────────── MLP_LAYERS[spec.mlp] ┘

A new kind plugs in by adding an entry, never by branching the model or the engine:
``@register_mlp("moe")`` on the sparse MLP of :mod:`labkit.model.moe` (the config's
``num_experts``, ``decoder_sparse_step`` and ``mlp_only_layers`` pick its layers),
``@register_attention("mla")`` on latent attention (issue 33), and the config's ``layer_spec``
saying which layers use them. The KV caches and attention backends read the same specs
(:func:`layer_sliding_windows`), so a window reaches ``kv_cache.attend(layer_idx, ...)`` per
layer; a hybrid KV manager (issue 33) groups layers by it. A latent layer ("mla",
:mod:`labkit.model.mla`) caches one latent per token instead of K and V
(:func:`layer_kv_latent_dims`), and calls ``kv_cache.attend_latent`` instead of ``attend``.

**Storage layout = Hugging Face's names.** Every layer keeps ``q_proj, k_proj, v_proj, o_proj,
gate_proj, up_proj, down_proj`` as separate ``nn.Linear`` modules under HF's parameter names
(an MoE layer's experts are stacked under transformers 5's in-memory names instead; features
that need the dense names refuse MoE models by name, :func:`labkit.model.moe.refuse_moe`).
The loader, the quantizers (``labkit.quant`` swap linears by name), the tensor-parallel shard plan
(``labkit.parallel``), GGUF export, pruning and the lean draft all address weights by those
names; a checkpoint loads 1:1 and exports exactly.

**Fused projections are a transform, not the layout** (the design note proposed fused storage; we
decided against it). q|k|v as one matmul and gate|up as one are an opt-in pass applied *after*
loading, the way quantization swaps modules: it replaces ``q_proj/k_proj/v_proj`` with one
``qkv_proj`` whose output splits into the three, and ``gate_proj/up_proj`` with ``gate_up_proj``.
The runtime layout is the same as fused storage would give, while the model file stays readable,
HF checkpoints load without renaming and every by-name consumer above keeps working on the
unfused model. The seam: :meth:`Attention.project_qkv` and :meth:`MLP.gate_up` (in
:mod:`labkit.model.llama`) are the only places that call those projections, so the transform
(issue 31) installs the fused module and overrides those two methods on the instance, nothing
else. LoRA (issue 29), TP and EP then work per output slice of a fused module (the slices are
exactly the HF weights, in q, k, v / gate, up order).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from labkit.model.config import ConfigError, ModelConfig

LayerFactory = Callable[[ModelConfig, int], nn.Module]

ATTENTION_LAYERS: dict[str, LayerFactory] = {}  # LayerSpec.attention -> module(config, i)
MLP_LAYERS: dict[str, LayerFactory] = {}  # LayerSpec.mlp -> module(config, i)


def _register(registry: dict[str, LayerFactory], names: tuple[str, ...]
              ) -> Callable[[LayerFactory], LayerFactory]:
    def deco(factory: LayerFactory) -> LayerFactory:
        for name in names:
            if name in registry and registry[name] is not factory:
                raise ValueError(f"layer kind {name!r} is already registered to "
                                 f"{registry[name].__name__}")
            registry[name] = factory
        return factory
    return deco


def register_attention(*names: str) -> Callable[[LayerFactory], LayerFactory]:
    """Class decorator: build ``cls(config, layer_idx)`` for layers whose spec's ``attention``
    is one of ``names``."""
    return _register(ATTENTION_LAYERS, names)


def register_mlp(*names: str) -> Callable[[LayerFactory], LayerFactory]:
    """Class decorator: build ``cls(config, layer_idx)`` for layers whose spec's ``mlp`` is one
    of ``names``."""
    return _register(MLP_LAYERS, names)


def _make(registry: dict[str, LayerFactory], what: str, kind: str, config: ModelConfig,
          layer_idx: int) -> nn.Module:
    if kind not in registry:
        raise ConfigError(f"layer {layer_idx} asks for {what} {kind!r}; labkit builds "
                          f"{', '.join(sorted(registry))}")
    return registry[kind](config, layer_idx)


def make_attention(config: ModelConfig, layer_idx: int) -> nn.Module:
    """Layer ``layer_idx``'s attention module, as its :class:`LayerSpec` says."""
    return _make(ATTENTION_LAYERS, "attention", config.layer_spec(layer_idx).attention, config,
                 layer_idx)


def make_mlp(config: ModelConfig, layer_idx: int) -> nn.Module:
    """Layer ``layer_idx``'s MLP module, as its :class:`LayerSpec` says."""
    return _make(MLP_LAYERS, "mlp", config.layer_spec(layer_idx).mlp, config, layer_idx)


def layer_sliding_windows(config: object) -> list[int | None]:
    """Each layer's sliding window (None = full attention), for the KV caches and backends.

    Takes any config with ``num_hidden_layers``; one without ``layer_spec`` (a hand-made
    stand-in) falls back to its ``sliding_window`` for every layer, as Mistral means it."""
    n = config.num_hidden_layers
    if hasattr(config, "layer_spec"):
        return [config.layer_spec(i).sliding_window for i in range(n)]
    return [getattr(config, "sliding_window", None)] * n


def layer_kv_latent_dims(config: object) -> list[int | None]:
    """Each layer's cached latent width (``kv_lora_rank + qk_rope_head_dim``) for a latent
    attention ("mla") layer, None for a layer that caches per-head K and V: how the KV caches
    shape (and the memory planner counts) each layer's entries. A config without layer specs
    caches K and V everywhere."""
    n = config.num_hidden_layers
    if not hasattr(config, "layer_spec") or getattr(config, "mla", None) is None:
        return [None] * n
    return [config.mla.latent_dim if config.layer_spec(i).attention == "mla" else None
            for i in range(n)]

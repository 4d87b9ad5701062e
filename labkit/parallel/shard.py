"""Build one rank's shard: an ordinary Llama with the parallel layers swapped in, loaded slice
by slice.

From a checkpoint folder each rank reads only its own rows or columns: safetensors files are
memory-mapped and ``get_slice`` copies just the requested range, so a rank never holds (or
reads) a whole tensor it does not own. That is what lets a 70B model load onto 8 GPUs that
could not each hold it. An expert-parallel rank reads only its own experts' tensors (each
expert is its own tensor on disk; the stacked in-memory parameter is filled through views).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from labkit.model.config import ModelConfig
from labkit.model.llama import LlamaForCausalLM
from labkit.model.meta import materialize
from labkit.parallel.comm import TPGroup
from labkit.parallel.expert import ExpertParallelMoE
from labkit.parallel.layers import ParallelLMHead, RowParallelLinear, VocabParallelEmbedding
from labkit.parallel.plan import ShardPlan, shard_config

# (dim, range) of each tensor kind a rank owns; None = the whole tensor (norms, row biases).
_Slice = tuple[int, tuple[int, int]] | None


class TensorSource:
    """Reads a named tensor, or a slice of it along one dimension, from somewhere."""

    def names(self) -> set[str]:
        raise NotImplementedError

    def read(self, name: str, part: _Slice) -> torch.Tensor:
        raise NotImplementedError


class SafetensorsSource(TensorSource):
    """A Hugging Face folder's safetensors, memory-mapped; slices read only their bytes."""

    def __init__(self, folder: str | Path) -> None:
        folder = Path(folder)
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            wm = json.loads(index.read_text())["weight_map"]
            self._files = {n: folder / f for n, f in wm.items()}
        else:
            f = folder / "model.safetensors"
            with safe_open(str(f), framework="pt") as st:
                self._files = {n: f for n in st.keys()}

    def names(self) -> set[str]:
        return set(self._files)

    def read(self, name: str, part: _Slice) -> torch.Tensor:
        with safe_open(str(self._files[name]), framework="pt") as st:
            if part is None:
                return st.get_tensor(name)
            dim, (a, b) = part
            sl = st.get_slice(name)
            return sl[a:b] if dim == 0 else sl[:, a:b]


class StateDictSource(TensorSource):
    """An in-memory model's tensors (tests and notebooks that build a model on the fly)."""

    def __init__(self, state: dict[str, torch.Tensor]) -> None:
        self._state = state

    def names(self) -> set[str]:
        return set(self._state)

    def read(self, name: str, part: _Slice) -> torch.Tensor:
        t = self._state[name]
        if part is None:
            return t
        dim, (a, b) = part
        return t.narrow(dim, a, b - a)


def slice_spec(name: str, plan: ShardPlan) -> _Slice:
    """Which part of the full tensor ``name`` rank ``plan.rank`` owns."""
    leaf = name.rsplit(".", 2)[-2:]  # e.g. ["q_proj", "weight"]
    module, kind = leaf[0], leaf[1]
    if module == "experts":  # stacked [E, ...] (an in-memory model's state): my experts' rows
        return 0, plan.expert_range
    if ".shared_expert." in name:  # Qwen2-MoE's shared expert is replicated, not sliced
        return None
    if module in ("q_proj",):
        return 0, plan.q_rows
    if module in ("k_proj", "v_proj"):
        return 0, plan.kv_rows
    if module in ("gate_proj", "up_proj"):
        return 0, plan.mlp_rows
    if module == "o_proj":
        return (1, plan.q_rows) if kind == "weight" else None
    if module == "down_proj":
        return (1, plan.mlp_rows) if kind == "weight" else None
    if module in ("embed_tokens", "lm_head"):
        return 0, plan.vocab_rows
    return None  # layer norms


def _swap_parallel_layers(model: LlamaForCausalLM, config: ModelConfig, plan: ShardPlan,
                          group: TPGroup) -> None:
    h, d = config.hidden_size, config.head_dim
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.o_proj = RowParallelLinear(plan.num_heads * d, h, config.o_proj_bias,
                                                   group, f"layer {i} attention")
        if plan.experts_per_rank and config.is_moe_layer(i):
            layer.mlp = ExpertParallelMoE(config, i, plan, group)
        else:
            layer.mlp.down_proj = RowParallelLinear(plan.intermediate, h, False, group,
                                                    f"layer {i} mlp")
    model.model.embed_tokens = VocabParallelEmbedding(plan.vocab_rows, plan.vocab_per_rank, h,
                                                      group)
    model.lm_head = ParallelLMHead(plan.vocab_per_rank, h, config.vocab_size, group)


def build_shard(config: ModelConfig, plan: ShardPlan, source: TensorSource, group: TPGroup,
                dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> LlamaForCausalLM:
    """This rank's model, every parameter loaded from ``source``; unknown or missing tensors
    raise ValueError by name."""
    with torch.device("meta"):
        model = LlamaForCausalLM(shard_config(config, plan))
        _swap_parallel_layers(model, config, plan, group)
    model = materialize(model, device).to(dtype)  # to_empty imports sympy (model/meta.py)
    params = dict(model.named_parameters())
    views, parts, foreign = _expert_views(model)
    names = source.names() - {n for n in source.names() if n.endswith("rotary_emb.inv_freq")}
    if config.tie_word_embeddings:
        names.discard("lm_head.weight")
    unknown = sorted(names - set(params) - set(views) - foreign - {"lm_head.weight"})
    if unknown:
        raise ValueError(f"checkpoint tensors not in the model: {unknown[:3]}")
    for pname, p in params.items():
        src = "model.embed_tokens.weight" if (pname == "lm_head.weight"
                                              and config.tie_word_embeddings) else pname
        if src not in names and src in parts:  # per-expert tensors on disk
            _load_views(source, parts[src], views, names)
            continue
        if src not in names:
            raise ValueError(f"checkpoint is missing tensor {src!r}")
        t = source.read(src, slice_spec(src, plan))
        _copy_padded(p, t)
    return model.eval()


def _expert_views(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, list[str]],
                                             set[str]]:
    """For the expert-parallel MoE layers: on-disk name -> view of its slice of a stacked
    parameter, parameter -> its on-disk names, and the on-disk names other ranks own."""
    views: dict[str, torch.Tensor] = {}
    parts: dict[str, list[str]] = {}
    foreign: set[str] = set()
    for prefix, m in model.named_modules():
        if isinstance(m, ExpertParallelMoE):
            for disk, (param, view) in m.checkpoint_tensors(prefix).items():
                views[disk] = view
                parts.setdefault(param, []).append(disk)
            foreign |= m.foreign_tensors(prefix)
    return views, parts, foreign


def _load_views(source: TensorSource, disk_names: list[str], views: dict[str, torch.Tensor],
                names: set[str]) -> None:
    for disk in disk_names:
        if disk not in names:
            raise ValueError(f"checkpoint is missing tensor {disk!r}")
        t = source.read(disk, None)
        if t.shape != views[disk].shape:
            raise ValueError(f"tensor {disk!r} has shape {tuple(t.shape)}, the model expects "
                             f"{tuple(views[disk].shape)}")
        with torch.no_grad():
            views[disk].copy_(t)


def _copy_padded(p: nn.Parameter, t: torch.Tensor) -> None:
    """Copy t into p; the last vocabulary shard is shorter than its padded parameter."""
    with torch.no_grad():
        if t.shape == p.shape:
            p.copy_(t)
            return
        if t.dim() != 2 or t.shape[1] != p.shape[1] or t.shape[0] > p.shape[0]:
            raise ValueError(f"tensor of shape {tuple(t.shape)} does not fit parameter "
                             f"{tuple(p.shape)}")
        p.zero_()
        p[: t.shape[0]].copy_(t)

"""Tiny random checkpoints of each supported architecture (shared by the parallel tests)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from safetensors.torch import save_file

from labkit.model.config import ModelConfig
from labkit.model.llama import LlamaForCausalLM
from labkit.parallel.comm import TPGroup
from labkit.parallel.shard_worker import ShardFactory

BASE = dict(vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=128)

ARCHS = {
    "llama_gqa": dict(BASE),
    "llama_mqa": dict(BASE, num_key_value_heads=1),  # fewer KV heads than ranks: replicated
    "qwen2_bias": dict(BASE, architecture="Qwen2ForCausalLM", attention_bias=True,
                       tie_word_embeddings=True),
    "mistral_window": dict(BASE, architecture="MistralForCausalLM", sliding_window=8),
    # per-layer windows: Qwen2's config.json (use_sliding_window + layer_types) to every rank
    "qwen2_window_layers": dict(BASE, architecture="Qwen2ForCausalLM", attention_bias=True,
                                sliding_window=6,
                                layer_types=["sliding_attention", "full_attention"]),
}


def save_checkpoint(model: LlamaForCausalLM, folder) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(model.config.to_hf_dict()))




class ShardSet:
    """One rank's shards of several checkpoints, answering ``call(name, method, *args)``."""

    def __init__(self, shards: dict) -> None:
        self.shards = shards

    def call(self, name: str, method: str, *args):
        return getattr(self.shards[name], method)(*args)


@dataclass
class ManyShards:
    """Builds every checkpoint's shard in the same worker processes: one start (torch imported
    once per rank) serves all of them. The shards share the process group; their collectives
    never interleave because the driver calls one model at a time."""

    models: dict[str, tuple[ModelConfig, str]]

    def __call__(self, group: TPGroup) -> ShardSet:
        return ShardSet({name: ShardFactory(cfg, folder=folder)(
            TPGroup(group.rank, group.world, distributed=True))
            for name, (cfg, folder) in self.models.items()})

"""Which exercises pass: a small local JSON file plus a widget that shows it.

The file lives at ``$LABKIT_PROGRESS`` if set, else ``~/.labkit/progress.json``. Every ``check``
records its result there, so progress survives kernel restarts and shows across notebooks.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

# Exercise key -> (notebook, one-line title). The order is the suggested order of study.
EXERCISES: dict[str, tuple[str, str]] = {
    "kv_cache_bytes": ("01_kv_cache_size", "KV-cache bytes with grouped-query attention"),
    "block_allocator": ("02_block_allocator", "Block allocator: ref counts, fork, copy-on-write"),
    "block_hashes": ("03_prefix_caching", "Chained prefix-block hashes"),
    "longest_cached_prefix": ("03_prefix_caching", "Longest cached prefix lookup"),
    "schedule_step": ("04_scheduler_step", "One continuous-batching step, decode first"),
    "latency_metrics": ("05_latency_metrics", "TTFT / TPOT / P99 from timestamps"),
    "int8_per_channel": ("06_quantization", "INT8 per-channel quantize / dequantize"),
    "int4_groupwise": ("06_quantization", "INT4 group-wise asymmetric quantize / dequantize"),
    "nf4_lookup": ("06_quantization", "NF4 code lookup with block absmax"),
    "spec_accept": ("07_speculative_decoding", "Speculative rejection-sampling rule"),
    "spec_speedup": ("07_speculative_decoding", "Expected speculative speed-up"),
    "triton_vector_add": ("08_triton_kernels", "Triton warm-up: vector add"),
    "triton_paged_attention": ("08_triton_kernels", "Triton paged-attention decode, one head"),
    "token_bucket": ("09_serving", "Per-key token bucket (429 + Retry-After)"),
    "disconnect_abort": ("09_serving", "Streaming endpoint that aborts on disconnect"),
    "gguf_q8_0": ("10_gguf_block_quantizers", "GGUF Q8_0 blocks, bytes equal to gguf's"),
    "gguf_q4_0": ("10_gguf_block_quantizers", "GGUF Q4_0 blocks, bytes equal to gguf's"),
    "distillation_loss": ("11_distillation_pruning", "Distillation loss with temperature and T²"),
    "mask_2_4": ("11_distillation_pruning", "2:4 semi-structured pruning mask"),
    "tp_shard_attention": ("12_tensor_parallel_attention",
                           "Tensor parallel: split q/k/v/o by heads (GQA-aware)"),
    "tp_attention_forward": ("12_tensor_parallel_attention",
                             "Tensor parallel: the all-reduce, on 2 gloo processes"),
    "prefix_affinity": ("13_prefix_affinity",
                        "Router: consistent hashing with bounded load on prefixes"),
    "moe_routing": ("14_moe_routing", "MoE: top-k gating and the dispatch/combine permutation"),
    "lora_delta": ("15_lora_batching", "Multi-LoRA: the batched delta for rows of mixed adapters"),
    "lora_slots": ("15_lora_batching", "Multi-LoRA: the adapter slots' LRU, never evicting one "
                   "in use"),
    "kv_connector": ("16_kv_connector", "KV connector: matched tokens, salted keys, load targets"),
    "mla_window": ("17_mla_and_windows",
                   "MLA decode with absorbed weights; sliding-window block freeing"),
}


def progress_path() -> Path:
    """The JSON file progress is kept in (``LABKIT_PROGRESS`` overrides the default)."""
    env = os.environ.get("LABKIT_PROGRESS")
    return Path(env) if env else Path.home() / ".labkit" / "progress.json"


def load_progress() -> dict[str, dict[str, Any]]:
    """Progress per exercise: ``{"passed": bool, "attempts": int, "last_attempt": float, ...}``."""
    path = progress_path()
    if not path.exists():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}  # a corrupt file should never stop a learner; it is rewritten on the next check
    return data if isinstance(data, dict) else {}


def record(exercise: str, passed: bool, attempted: bool = True) -> dict[str, Any]:
    """Store one attempt. Once passed, an exercise stays passed (``passed_at`` keeps the first).

    ``attempted=False`` is a check of an untouched stub (it still raises NotImplementedError, or
    a Triton kernel stored nothing): not an attempt, so nothing is stored and the exercise stays
    "not tried". A fresh Run All of an exercise notebook must not mark every stub failed."""
    if exercise not in EXERCISES:
        raise ValueError(f"unknown exercise {exercise!r}; valid: {', '.join(EXERCISES)}")
    data = load_progress()
    if not attempted:
        if passed:
            raise ValueError("an unattempted check cannot pass")
        return data.get(exercise, {"passed": False, "attempts": 0})
    entry = data.get(exercise, {"passed": False, "attempts": 0})
    entry["attempts"] = int(entry.get("attempts", 0)) + 1
    entry["last_attempt"] = time.time()
    entry["last_passed"] = bool(passed)
    if passed and not entry.get("passed"):
        entry["passed"] = True
        entry["passed_at"] = entry["last_attempt"]
    data[exercise] = entry
    path = progress_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
    tmp.replace(path)  # atomic: two notebooks checking at once never leave half a file
    return entry


def reset_progress() -> None:
    """Forget all progress (deletes the file)."""
    progress_path().unlink(missing_ok=True)


def summary() -> str:
    """Plain-text table of every exercise and its state."""
    data = load_progress()
    done = sum(1 for k in EXERCISES if data.get(k, {}).get("passed"))
    lines = [f"{done}/{len(EXERCISES)} exercises passed  ({progress_path()})"]
    for key, (nb, title) in EXERCISES.items():
        e = data.get(key, {})
        mark = "✓" if e.get("passed") else ("✗" if e.get("attempts") else "·")
        lines.append(f"  {mark} {key:<24} {title}  [{nb}]  attempts: {e.get('attempts', 0)}")
    return "\n".join(lines)


def progress_widget() -> Any:
    """An ipywidgets view: a progress bar with its count, one row per exercise, a refresh
    button."""
    import ipywidgets as w

    bar = w.IntProgress(min=0, max=len(EXERCISES), description="passed")
    count = w.Label()
    table = w.HTML()
    button = w.Button(description="refresh", icon="refresh")

    def refresh(_: Any = None) -> None:
        data = load_progress()
        rows = []
        for key, (nb, title) in EXERCISES.items():
            e = data.get(key, {})
            if e.get("passed"):
                mark, color = "✓ passed", "#1a7f37"
            elif e.get("attempts"):
                mark, color = "✗ not yet", "#cf222e"
            else:
                mark, color = "· not tried", "#6e7781"
            rows.append(f"<tr><td><code>{key}</code></td><td>{title}</td><td>{nb}</td>"
                        f"<td style='color:{color}'>{mark}</td>"
                        f"<td>{e.get('attempts', 0)}</td></tr>")
        bar.value = sum(1 for k in EXERCISES if data.get(k, {}).get("passed"))
        count.value = f"{bar.value} of {len(EXERCISES)} exercises passed"
        table.value = ("<table><tr><th>exercise</th><th>what</th><th>notebook</th><th>state</th>"
                       "<th>attempts</th></tr>" + "".join(rows) + "</table>")

    button.on_click(refresh)
    refresh()
    return w.VBox([w.HBox([bar, count, button]), table])

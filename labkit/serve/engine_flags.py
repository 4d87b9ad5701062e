"""The engine features ``labkit serve`` turns on from its command line, in vLLM's flag names.

    --quantization int8|int4|nf4|fp8   quantize the decoder's linears at load (round to nearest)
    --quantization gptq|awq            MODEL is a folder already quantized in GPTQ / AWQ layout
    --quantization gguf                MODEL is a .gguf file (its own quantization)
    --speculative-config JSON          e.g. '{"method": "ngram", "num_speculative_tokens": 4}'
    --kv-cache-dtype auto|int8|fp8     the paged KV pool's element type
    --attention-backend torch|triton   the paged-attention implementation
    --enable-prefix-caching / --no-enable-prefix-caching
    --disable-hybrid-kv-cache-manager  one block table for a sliding + full model (nothing freed)
    --seed S                           seeds for unseeded requests (not an engine setting)
    --fused, --compile                 the step cures of ``LLM(fused=True, compile=True)``
                                       (``engine/model_setup.py``'s ``step_cures``)
    --async-scheduling                 schedule step N+1 while step N's forward runs
                                       (``engine/overlap.py``)
    --kv-transfer-config JSON          a KV connector, e.g. '{"kv_connector": "offloading",
                                       "kv_connector_extra_config": {"cpu_bytes": 1073741824}}'
    --kv-offload-cpu-bytes N, --kv-offload-dir DIR, --kv-offload-disk-bytes N
                                       the offloading connector's tiers (a shorthand for the
                                       JSON above; folded into it by :func:`fold_kv_offload`)
    --kv-role prefill|decode [--kv-transfer-port P]
                                       prefill/decode disaggregation (the p2p connector; a
                                       decode instance receives KV on port P; also folded)
    --enable-lora [--max-loras N] [--max-lora-rank R] [--max-cpu-loras N]
                                       adapter slots (labkit.lora); --lora-modules NAME=PATH
                                       ... names the adapters served from the start (a server
                                       setting: labkit/serve/lora_routes.py loads them)

Why here and not in the launcher: the same names must reach both engine homes (a thread of the
server, or the engine process through a pickled EngineSpec), so they travel as plain values in
``engine_kw`` and :func:`load_for_serving` applies the one that is not an engine setting
(quantization changes the model, not the engine). A combination that cannot run is refused at
start (``ValueError``: the launcher prints it), never at the first request.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from labkit.config import ATTENTION_BACKENDS, KV_CACHE_DTYPES

# vLLM's name -> labkit.quant.model.quantize_model's format (None: the checkpoint carries it)
QUANTIZATION = {"int8": "int8", "int4": "int4_rtn", "nf4": "nf4", "fp8": "fp8",
                "gptq": None, "awq": None, "gguf": None}
KV_OFFLOAD_FLAGS = {"kv_offload_cpu_bytes": "cpu_bytes", "kv_offload_dir": "disk_dir",
                    "kv_offload_disk_bytes": "disk_bytes"}  # flag -> the connector's setting
KV_ROLE_FLAGS = {"prefill": "kv_producer", "decode": "kv_consumer"}  # flag -> vLLM's kv_role
FEATURE_FLAGS = ("quantization", "speculative_config", "kv_cache_dtype", "attention_backend",
                 "enable_prefix_caching", "kv_transfer_config", *KV_OFFLOAD_FLAGS,
                 "kv_role", "kv_transfer_port",
                 "enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras",
                 "fused", "compile", "async_scheduling", "disable_hybrid_kv_cache_manager")
STEP_CURES = ("fused", "compile")  # change the model before the engine is built, not settings
LORA_SIZES = ("max_loras", "max_lora_rank", "max_cpu_loras")


def _json_object(s: str) -> dict[str, Any]:
    try:
        d = json.loads(s)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON ({e}): {s!r}") from None
    if not isinstance(d, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object, got {s!r}")
    return d


def add_feature_args(p: argparse.ArgumentParser) -> None:
    """The flags above, each defaulting to None (the engine's own default)."""
    p.add_argument("--quantization", "-q", choices=sorted(QUANTIZATION), default=None,
                   help="int8 | int4 | nf4 | fp8: quantize the weights at load; gptq | awq: "
                   "MODEL is a checkpoint already quantized in that layout; gguf: a .gguf file")
    p.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "ngram", '
                   '"num_speculative_tokens": 4}\' or \'{"method": "draft_model", '
                   '"model": "NAME", "num_speculative_tokens": 4}\'')
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=None)
    p.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=None, help="reuse the KV of shared prompt prefixes (default on)")
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true", default=None,
                   help="one block table for models that mix sliding and full layers (keeps "
                   "every block; vLLM's flag)")
    p.add_argument("--kv-transfer-config", type=_json_object, default=None, metavar="JSON",
                   help='a KV connector, e.g. \'{"kv_connector": "offloading", '
                   '"kv_connector_extra_config": {"cpu_bytes": 1073741824}}\'')
    p.add_argument("--kv-offload-cpu-bytes", type=int, default=None, metavar="N",
                   help="offload KV blocks to a CPU tier of N bytes (the offloading connector)")
    p.add_argument("--kv-offload-dir", default=None, metavar="DIR",
                   help="and spill them to files under DIR (with --kv-offload-disk-bytes)")
    p.add_argument("--kv-offload-disk-bytes", type=int, default=None, metavar="N")
    p.add_argument("--kv-role", choices=sorted(KV_ROLE_FLAGS), default=None,
                   help="prefill: push each finished request's KV to the decode instance its "
                   "kv_transfer_params name; decode: receive KV on --kv-transfer-port")
    p.add_argument("--kv-transfer-port", type=int, default=None, metavar="P",
                   help="where a --kv-role decode instance listens for KV (127.0.0.1)")
    p.add_argument("--enable-lora", action="store_true", default=None,
                   help="serve LoRA adapters (PEFT folders) mixed in one batch")
    p.add_argument("--lora-modules", nargs="+", type=_lora_module, default=None,
                   metavar="NAME=PATH", help="adapters served from the start; a request's "
                   "model field picks one by NAME (needs --enable-lora)")
    for name, help in (("max-loras", "adapters resident at once (device slots)"),
                       ("max-lora-rank", "the highest adapter rank served"),
                       ("max-cpu-loras", "adapters kept loaded in the CPU cache (LRU)")):
        p.add_argument(f"--{name}", type=int, default=None, metavar="N", help=help)
    p.add_argument("--fused", action="store_true", default=None,
                   help="fuse q|k|v, gate|up, the residual adds into the norms, the rotary table")
    p.add_argument("--compile", action="store_true", default=None,
                   help="compile the forward piecewise around attention (inductor)")
    p.add_argument("--async-scheduling", action="store_true", default=None,
                   help="schedule the next step and detokenise the last while a forward runs "
                   "(vLLM's flag)")
    p.add_argument("--seed", type=int, default=None,
                   help="requests without a seed get one from a generator seeded with this, "
                   "in arrival order (labkit/serve/model_card.py)")


def _lora_module(s: str) -> tuple[str, str]:
    name, eq, path = s.partition("=")
    if not name or not eq or not path:
        raise argparse.ArgumentTypeError(f"--lora-modules takes NAME=PATH, got {s!r}")
    return name, path


def lora_modules_of(args: argparse.Namespace) -> dict[str, str]:
    """``--lora-modules`` as ``{name: path}``; a repeated name or a missing ``--enable-lora``
    is a ValueError (the launcher exits 2 with it)."""
    pairs = getattr(args, "lora_modules", None) or []
    names = [n for n, _ in pairs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"--lora-modules names {dup} more than once")
    if pairs and not getattr(args, "enable_lora", None):
        raise ValueError("--lora-modules needs --enable-lora (as vLLM asks)")
    return dict(pairs)


def features_of(args: argparse.Namespace) -> dict[str, Any]:
    """The feature flags a server was started with (those given), for ``/v1/models``."""
    names = (*FEATURE_FLAGS, "seed", "tensor_parallel_size", "enable_expert_parallel", "dtype")
    return {k: getattr(args, k) for k in names if getattr(args, k, None) is not None}


def fold_kv_offload(kw: dict[str, Any]) -> None:
    """Turn the ``--kv-offload-*`` values in ``kw`` into the offloading connector's
    ``kv_transfer_config`` (in place; without them ``kw`` keeps what it has)."""
    extra = {KV_OFFLOAD_FLAGS[k]: kw.pop(k) for k in list(kw) if k in KV_OFFLOAD_FLAGS}
    extra = {k: v for k, v in extra.items() if v is not None}
    if not extra:
        return
    if kw.get("kv_transfer_config") is not None:
        raise ValueError("--kv-offload-* configure the offloading connector; give them or "
                         "--kv-transfer-config, not both")
    kw["kv_transfer_config"] = {"kv_connector": "offloading", "kv_connector_extra_config": extra}


def fold_kv_role(kw: dict[str, Any], model: str) -> None:
    """Turn ``--kv-role`` / ``--kv-transfer-port`` in ``kw`` into the p2p connector's
    ``kv_transfer_config`` (in place). Both sides name the model the same way (its folder or
    file name), which the receiver checks on every transfer."""
    role, port = kw.pop("kv_role", None), kw.pop("kv_transfer_port", None)
    if role is None:
        if port is not None:
            raise ValueError("--kv-transfer-port goes with --kv-role decode")
        return
    if kw.get("kv_transfer_config") is not None:
        raise ValueError("--kv-role configures the p2p connector; give it or "
                         "--kv-transfer-config / --kv-offload-*, not both")
    extra: dict[str, Any] = {"model": Path(str(model)).name}
    if role == "decode":
        if port is None or not 0 < port < 65536:
            raise ValueError("--kv-role decode needs --kv-transfer-port P (1..65535): the "
                             "router tells prefill instances where to push")
        extra.update(host="127.0.0.1", port=port)
    elif port is not None:
        raise ValueError("--kv-transfer-port is where a decode instance listens; a prefill "
                         "instance pushes to the port each request names")
    kw["kv_transfer_config"] = {"kv_connector": "p2p", "kv_role": KV_ROLE_FLAGS[role],
                                "kv_connector_extra_config": extra}


def check_features(model: str, kw: dict[str, Any]) -> None:
    """Refuse, before anything loads, a combination the engine cannot run."""
    folded = dict(kw)
    fold_kv_offload(folded)  # raises on --kv-offload-* with --kv-transfer-config
    fold_kv_role(folded, model)
    from labkit.engine.model_setup import check_step_cures

    check_step_cures(kw, bool(kw.get("fused")), bool(kw.get("compile")))
    sizes = sorted(k for k in LORA_SIZES if kw.get(k) is not None)
    if sizes and not kw.get("enable_lora"):
        raise ValueError(f"{['--' + k.replace('_', '-') for k in sizes]} only apply with "
                         "--enable-lora")
    q = kw.get("quantization")
    if q is None:
        return
    if q not in QUANTIZATION:
        raise ValueError(f"--quantization {q!r}: choose one of {sorted(QUANTIZATION)}")
    gguf = str(model).endswith(".gguf")
    if (q == "gguf") != gguf:
        raise ValueError(f"--quantization gguf goes with a .gguf MODEL, and a .gguf MODEL with "
                         f"--quantization gguf or none (got {q!r} for {model!r})")
    if (kw.get("tensor_parallel_size") or 1) > 1:
        raise ValueError(f"--quantization {q} with --tensor-parallel-size > 1 is not supported: "
                         "the workers load full-precision slices")
    if q in ("gptq", "awq") and not (Path(model) / "config.json").is_file():
        raise ValueError(f"--quantization {q} loads a checkpoint folder already quantized in "
                         f"that layout (labkit.quant.checkpoint.save_quantized writes one); "
                         f"{model!r} is not a folder with a config.json")


def load_for_serving(model: str, quantization: str | None, dtype: str | None,
                     device: str | None) -> tuple[Any, Any]:
    """(model, tokenizer) as ``--quantization`` asks: quantized at load, or read from a
    GPTQ / AWQ folder, or loaded as is."""
    from labkit.model.loader import load_pretrained

    if quantization in ("gptq", "awq"):
        return _load_prequantized(model, quantization, dtype, device)
    m, tok = load_pretrained(model, dtype=dtype, device=device)
    fmt = QUANTIZATION.get(quantization) if quantization else None
    if fmt is not None:
        from labkit.quant.model import quantize_model

        m = quantize_model(m, fmt, group_fallback=True, inplace=True)
    return m.eval(), tok


def _load_prequantized(model: str, method: str, dtype: str | None, device: str | None
                       ) -> tuple[Any, Any]:
    import torch

    from labkit.model.tokenizer import Tokenizer
    from labkit.quant.checkpoint import load_quantized

    qc = json.loads((Path(model) / "config.json").read_text()).get("quantization_config") or {}
    if qc.get("quant_method") != method:
        raise ValueError(f"--quantization {method}: {model}/config.json's quantization_config "
                         f"says {qc.get('quant_method')!r}")
    m = load_quantized(model, device or "cpu", getattr(torch, dtype) if dtype else torch.float32)
    eos = m.config.eos_token_ids
    tok = Tokenizer.from_dir(model, m.config.bos_token_id, eos[0] if eos else None)
    return m.eval(), tok

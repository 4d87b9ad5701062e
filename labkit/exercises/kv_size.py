"""Exercise: how many bytes does the KV cache take? (grouped-query attention included)

Every interview on serving starts here: the KV cache, not the weights, decides how many requests
fit on a GPU. Write::

    def kv_cache_bytes(num_layers: int, num_attention_heads: int, num_kv_heads: int,
                       head_dim: int, seq_len: int, batch_size: int, dtype: torch.dtype) -> int:
        '''Bytes of K and V cached for `batch_size` sequences of `seq_len` tokens each.'''

The reference is what real tensors of those shapes occupy (built on torch's ``meta`` device, so
no memory is touched), cross-checked with the simulator's model presets where they exist.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from labkit.exercises.checks import CheckFailure, call, run_check, signature
from labkit.sim.presets import MODELS

# (name, layers, query heads, kv heads, head dim): public configs (design.md's table).
_MODELS = [
    ("llama-2-7b", 32, 32, 32, 128),
    ("llama-3-8b", 32, 32, 8, 128),
    ("qwen2.5-7b", 28, 28, 4, 128),
    ("llama-2-70b", 80, 64, 8, 128),
    ("labkit-tiny", 6, 8, 2, 32),
]


def reference_kv_cache_bytes(num_layers: int, num_attention_heads: int, num_kv_heads: int,
                             head_dim: int, seq_len: int, batch_size: int,
                             dtype: torch.dtype) -> int:
    """Measure, don't multiply: the bytes of the actual K and V tensors an engine would hold."""
    shape = (batch_size, seq_len, num_kv_heads, head_dim)
    k = torch.empty(shape, dtype=dtype, device="meta")
    return 2 * num_layers * k.nelement() * k.element_size()


def _cases() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    cases = []
    for name, layers, hq, hkv, d in _MODELS:
        for seq, batch, dtype in [(4096, 1, torch.float16), (8192, 8, torch.bfloat16),
                                  (1, 1, torch.float32), (2048, 3, torch.int8)]:
            cases.append(dict(num_layers=layers, num_attention_heads=hq, num_kv_heads=hkv,
                              head_dim=d, seq_len=seq, batch_size=batch, dtype=dtype, _name=name))
    for _ in range(20):
        hkv = int(torch.randint(1, 9, (1,), generator=g))
        group = int(torch.randint(1, 9, (1,), generator=g))
        dtype = [torch.float16, torch.float32, torch.int8, torch.bfloat16][
            int(torch.randint(0, 4, (1,), generator=g))]
        cases.append(dict(num_layers=int(torch.randint(1, 81, (1,), generator=g)),
                          num_attention_heads=hkv * group, num_kv_heads=hkv,
                          head_dim=int(torch.randint(1, 5, (1,), generator=g)) * 32,
                          seq_len=int(torch.randint(1, 20000, (1,), generator=g)),
                          batch_size=int(torch.randint(1, 65, (1,), generator=g)),
                          dtype=dtype, _name="random"))
    return cases


def _hint(case: dict, actual: object, expected: int) -> str:
    c = {k: v for k, v in case.items() if not k.startswith("_")}
    elem = torch.empty((), dtype=c["dtype"]).element_size()
    if not isinstance(actual, int) or isinstance(actual, bool):
        return "return a Python int (number of bytes), e.g. int(...) around a float result."
    if actual * c["num_kv_heads"] == expected * c["num_attention_heads"] and \
            c["num_kv_heads"] != c["num_attention_heads"]:
        return ("you cached num_attention_heads heads; with GQA only num_kv_heads KV heads are "
                "stored (query heads share them).")
    if elem != 2 and actual * elem == expected * 2:
        return f"{c['dtype']} takes {elem} byte(s) per element; don't assume 2."
    if actual * 2 == expected:
        return "K and V are both cached: there is a factor 2."
    if actual * elem == expected:
        return "you counted elements, not bytes: multiply by the dtype's element size."
    return "bytes = 2 (K and V) x layers x kv heads x head_dim x tokens x batch x element size."


def check(kv_cache_bytes: Callable[..., int]) -> object:
    """Check a learner's ``kv_cache_bytes`` on real model shapes and random GQA configs."""

    def body() -> str:
        from_presets = _preset_cross_check()
        for case in _cases():
            kwargs = {k: v for k, v in case.items() if not k.startswith("_")}
            expected = reference_kv_cache_bytes(**kwargs)
            actual = call(kv_cache_bytes, **kwargs)
            if not isinstance(actual, int) or isinstance(actual, bool) or actual != expected:
                raise CheckFailure(
                    f"wrong KV-cache size ({case['_name']})",
                    inputs=signature("kv_cache_bytes", (), kwargs),
                    expected=expected, actual=actual, hint=_hint(case, actual, expected))
        gib = reference_kv_cache_bytes(32, 32, 8, 128, 8192, 1, torch.bfloat16) / 2**30
        gib2 = reference_kv_cache_bytes(32, 32, 32, 128, 8192, 1, torch.bfloat16) / 2**30
        return (f"all {len(_cases())} cases right{from_presets}. Llama-3-8B holds {gib:.2f} GiB "
                f"of KV for one 8k-token sequence in bf16; Llama-2-7B (no GQA) {gib2:.2f} GiB.")

    return run_check("kv_cache_bytes", body)


def _preset_cross_check() -> str:
    """Agree with labkit.sim.presets where it exists (an independent implementation)."""
    for name, layers, hq, hkv, d in _MODELS:
        preset = MODELS.get(name)
        if preset is None:
            continue
        ours = reference_kv_cache_bytes(layers, hq, hkv, d, 1, 1, torch.float16)
        if ours != preset.kv_bytes_per_token:  # pragma: no cover - would be a labkit bug
            raise RuntimeError(f"labkit.sim.presets disagrees on {name}: "
                               f"{preset.kv_bytes_per_token} vs {ours}")
    return " (and the reference agrees with labkit.sim.presets)"

"""Small helpers every layer uses (the bottom layer, with :mod:`labkit.errors`)."""

from __future__ import annotations

import atexit
import gc
from numbers import Integral
from typing import Any

from labkit.errors import EngineConfigError


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of ``b`` hold ``a`` items."""
    return -(-a // b)


def is_int(x: Any) -> bool:
    """An integer that is not a bool (numpy integers count)."""
    return isinstance(x, Integral) and not isinstance(x, bool)


def check_int(name: str, value: Any, minimum: int = 1) -> int:
    """``value`` as an int >= ``minimum``; types are checked, never coerced (``int(1.7) == 1``
    would be a silent wrong answer)."""
    if not is_int(value) or value < minimum:
        raise EngineConfigError(f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def freeze_gc_heap() -> int:
    """Move every object alive now into CPython's permanent generation; returns how many.

    Why: a full (generation 2) collection walks every tracked object. A server that has
    imported torch and built an engine holds hundreds of thousands of them, so each full
    collection stalls the process for 100-200 ms on a small CPU, at a random moment under
    load: a request that arrives then waits that long for its first token (the p99 tail of
    ``labkit bench serve``'s noisy neighbour). The startup objects live until exit anyway, so
    freezing them loses nothing and later collections only walk what requests create.
    vLLM does the same after building its engine and in its serving benchmark's client.

    The freeze is undone at exit, so the interpreter's last collection still reaches those
    objects (frozen ones would never be finalized: Triton's bindings report them as leaks).
    """
    gc.collect()
    gc.freeze()
    atexit.unregister(gc.unfreeze)  # once, however often this is called
    atexit.register(gc.unfreeze)
    return gc.get_freeze_count()

"""Small helpers every layer uses (the bottom layer, with :mod:`labkit.errors`)."""

from __future__ import annotations

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

"""Attention backends by name, for ``get_attention_backend`` (kept free of torch imports).

The torch reference lives in :mod:`labkit.kv.attention`. The Triton backend lives in
``labkit.kernels``, whose kernels read K/V helpers from this package (:mod:`labkit.kv.ops`), so
``labkit.kv`` must not import it back: ``labkit/__init__.py`` registers it here, and it is
imported only when first asked for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_REGISTRY: dict[str, Callable[[], Any]] = {}


def register_attention_backend(name: str, factory: Callable[[], Any]) -> None:
    """Make ``get_attention_backend(name)`` return ``factory()``."""
    _REGISTRY[name] = factory


def registered_backends() -> dict[str, Callable[[], Any]]:
    return dict(_REGISTRY)

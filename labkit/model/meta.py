"""Building a model without initialising its weights: what every loader does first.

Loading overwrites every weight, so initialising them is wasted work; and on meta tensors
``nn.init``'s in-place ops dispatch through ``torch._refs``, whose first call imports
``torch._dynamo``, about a second of a new process's start (transformers' ``no_init_weights``
skips them for the same reason). Moving the meta model to a real device has the same trap:
``Module.to_empty`` calls ``torch.empty_like`` on each meta tensor, whose Python meta kernel
imports ``torch.fx.experimental.symbolic_shapes`` and with it sympy (about half a second of
every load); :func:`materialize` allocates from the shapes alone."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_INITS = ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_", "trunc_normal_")


@contextlib.contextmanager
def empty_model() -> Iterator[None]:
    """Build modules on the meta device without running their weight initialisers (the module
    docstring says why). Not thread-safe: it swaps ``torch.nn.init``'s functions while open."""
    saved = {name: getattr(torch.nn.init, name) for name in _INITS}
    try:
        for name in _INITS:
            setattr(torch.nn.init, name, lambda tensor, *a, **k: tensor)
        with torch.device("meta"):
            yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def materialize(model: torch.nn.Module, device: torch.device | str = "cpu") -> torch.nn.Module:
    """``model.to_empty(device=device)`` without the meta kernels: every parameter and buffer
    becomes an uninitialised tensor of its shape and dtype on ``device`` (the module docstring
    says why ``to_empty`` is avoided). Returns the model, as ``to_empty`` does."""
    dev = torch.device(device)
    return model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=dev))

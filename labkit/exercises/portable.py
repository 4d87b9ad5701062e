"""Send a learner's function to a spawned worker process.

Workers are started with ``spawn`` (``labkit.parallel.workers``), so everything they run is
pickled. A function written in a notebook lives in the kernel's ``__main__``, which a worker
cannot import, and pickle sends functions by reference (module + name): the worker would fail
with an AttributeError. So the checker sends the function's *code object* (``marshal``: both
processes run the same interpreter) together with the globals it names: modules by name, other
notebook functions the same way (recursively), anything else by pickle. What cannot be sent is
left out, and the worker raises ``NameError`` naming it, which the checker turns into a hint.
"""

from __future__ import annotations

import builtins
import importlib
import marshal
import pickle
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PortableFunction:
    """A function as bytes and names; ``load()`` rebuilds it in any process."""

    name: str
    code: bytes
    defaults: tuple | None = None
    kwdefaults: dict[str, Any] | None = None
    modules: dict[str, str] = field(default_factory=dict)       # global name -> module name
    values: dict[str, bytes] = field(default_factory=dict)      # global name -> pickle
    functions: dict[str, PortableFunction] = field(default_factory=dict)

    def load(self) -> Callable[..., Any]:
        g: dict[str, Any] = {"__builtins__": builtins, "__name__": "__labkit_learner__"}
        g.update({k: importlib.import_module(m) for k, m in self.modules.items()})
        g.update({k: pickle.loads(v) for k, v in self.values.items()})
        g.update({k: f.load() for k, f in self.functions.items()})
        fn = types.FunctionType(marshal.loads(self.code), g, self.name, self.defaults)
        fn.__kwdefaults__ = self.kwdefaults
        return fn


def _names(code: types.CodeType) -> Iterator[str]:
    """Global names a code object (and the functions/lambdas nested in it) may read."""
    yield from code.co_names
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _names(const)


def portable(fn: Callable[..., Any], _depth: int = 0) -> PortableFunction:
    """Capture ``fn`` (a plain top-level function) so a spawned process can run it."""
    if not isinstance(fn, types.FunctionType):
        raise TypeError(f"expected a function defined with def, got {type(fn).__name__}")
    if fn.__closure__:
        raise TypeError(f"{fn.__name__} uses variables of an enclosing function; define it at "
                        "the top level of the notebook (workers receive it on its own)")
    out = PortableFunction(fn.__name__, marshal.dumps(fn.__code__), fn.__defaults__,
                           fn.__kwdefaults__)
    for name in set(_names(fn.__code__)):
        if name not in fn.__globals__:
            continue  # a builtin, an attribute name, or genuinely undefined
        value = fn.__globals__[name]
        if isinstance(value, types.ModuleType):
            out.modules[name] = value.__name__
        elif isinstance(value, types.FunctionType) and value.__module__ == "__main__" \
                and _depth < 8:
            out.functions[name] = portable(value, _depth + 1)
        elif getattr(value, "__module__", None) != "__main__":
            try:
                out.values[name] = pickle.dumps(value)
            except Exception:  # noqa: BLE001 - unpicklable: the worker reports a NameError
                pass
    return out

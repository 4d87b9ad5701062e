"""The core reads in one sitting: no function in engine / sched / kv / spec over 50 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import labkit

ROOT = Path(labkit.__file__).parent
CORE = ("engine", "sched", "kv", "spec")
MAX_LINES = 50


def long_functions(source: str, name: str) -> list[str]:
    """``name:function (lines)`` for every function (methods and nested ones too) longer than
    MAX_LINES, counted from ``def`` (decorators aside) to its last line."""
    return [f"{name}:{n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > MAX_LINES]


def test_core_functions_are_short():
    found = [f for pkg in CORE for p in sorted((ROOT / pkg).rglob("*.py"))
             for f in long_functions(p.read_text(), str(p.relative_to(ROOT)))]
    assert not found, "split these functions: " + ", ".join(found)


def test_the_check_flags_a_long_function():
    """Negative control: a 51-line function (nested in a class) is reported, a 50-line one not."""
    def src(n: int) -> str:
        return "class A:\n    def f(self):\n" + "        x = 1\n" * (n - 1)

    assert long_functions(src(51), "m") == ["m:f (51 lines)"]
    assert long_functions(src(50), "m") == []

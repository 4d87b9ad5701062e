"""The code reads in one sitting: no function in engine / sched / kv / spec over 50 lines, and no
module of labkit (or kernels/) over 400 lines (one concept per module, nano-vllm's size)."""

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


MAX_MODULE_LINES = 400


def long_modules(root) -> list[str]:
    """``path (lines)`` of every .py file under ``root`` longer than MAX_MODULE_LINES."""
    return [f"{p.relative_to(root.parent)} ({n} lines)" for p in sorted(root.rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]


def test_modules_are_short():
    found = long_modules(ROOT) + long_modules(ROOT.parent / "kernels")
    assert not found, "split these modules (one concept each): " + ", ".join(found)


def test_the_module_check_flags_a_long_module(tmp_path):
    """Negative control: 401 lines are reported, 400 are not."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "ok.py").write_text("x = 1\n" * 400)
    assert long_modules(pkg) == []
    (pkg / "long.py").write_text("x = 1\n" * 401)
    assert long_modules(pkg) == ["pkg/long.py (401 lines)"]

"""The code reads in one sitting: no function of labkit (or kernels/) over 50 lines, and no
module over 400 lines (one concept per module, nano-vllm's size).

One exemption, stated: a ``@triton.jit`` kernel. A kernel is one launch (its loads, its loop and
its stores are one program a learner reads against the PyTorch reference beside it), and a
helper it calls would be another ``@triton.jit`` function inlined back in: splitting it moves
lines, it does not make the program shorter to follow."""

from __future__ import annotations

import ast
from pathlib import Path

import labkit

ROOT = Path(labkit.__file__).parent
MAX_LINES = 50


def _is_triton_kernel(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    """``@triton.jit`` or ``@triton.jit(...)`` (the one exemption, see the module docstring)."""
    for d in fn.decorator_list:
        target = d.func if isinstance(d, ast.Call) else d
        if ast.unparse(target) in ("triton.jit", "jit"):
            return True
    return False


def long_functions(source: str, name: str) -> list[str]:
    """``name:function (lines)`` for every function (methods and nested ones too) longer than
    MAX_LINES, counted from ``def`` (decorators aside) to its last line; Triton kernels aside."""
    return [f"{name}:{n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for n in ast.walk(ast.parse(source))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > MAX_LINES and not _is_triton_kernel(n)]


def test_functions_are_short():
    roots = (ROOT, ROOT.parent / "kernels")
    found = [f for root in roots for p in sorted(root.rglob("*.py"))
             for f in long_functions(p.read_text(), str(p.relative_to(root.parent)))]
    assert not found, "split these functions: " + ", ".join(found)


def test_the_check_flags_a_long_function():
    """Negative control: a 51-line function (nested in a class) is reported, a 50-line one not."""
    def src(n: int) -> str:
        return "class A:\n    def f(self):\n" + "        x = 1\n" * (n - 1)

    assert long_functions(src(51), "m") == ["m:f (51 lines)"]
    assert long_functions(src(50), "m") == []


def test_only_a_triton_kernel_is_exempt():
    """Negative control for the exemption: the same 60-line body is exempt under ``@triton.jit``
    (bare or called), and reported under any other decorator."""
    body = "def k(x):\n" + "    x = 1\n" * 59

    assert long_functions("@triton.jit\n" + body, "m") == []
    assert long_functions("@triton.jit(do_not_specialize=['x'])\n" + body, "m") == []
    assert long_functions("@torch.compile\n" + body, "m") == ["m:k (60 lines)"]
    assert long_functions(body, "m") == ["m:k (60 lines)"]


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

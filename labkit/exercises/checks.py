"""Shared machinery of the exercise checkers: precise failure reports, progress, gating.

A checker raises ``CheckFailure`` with the exact input, the expected and the actual value and a
hint; ``run_check`` turns that (or a pass) into a printed report, records progress and returns a
``CheckResult``. Checkers never stop a learner's notebook unless strict mode is on
(``LABKIT_STRICT_CHECKS=1``, implied by ``LABKIT_INJECT_SOLUTIONS=1``): CI runs the exercise
notebooks with the reference solutions injected and strict, so a regression fails the build.
"""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from labkit.exercises import progress


class CheckFailure(AssertionError):
    """A learner's function disagreed with the reference or broke a property."""

    def __init__(self, what: str, *, inputs: str | None = None, expected: Any = None,
                 actual: Any = None, hint: str | None = None, show_values: bool = True) -> None:
        self.what, self.inputs, self.hint = what, inputs, hint
        self.expected, self.actual, self.show_values = expected, actual, show_values
        super().__init__(self.report())

    def report(self) -> str:
        lines = [self.what]
        if self.inputs is not None:
            lines.append(f"  input:    {self.inputs}")
        if self.show_values:
            lines.append(f"  expected: {short(self.expected)}")
            lines.append(f"  actual:   {short(self.actual)}")
        if self.hint:
            lines.append(f"  hint:     {self.hint}")
        return "\n".join(lines)


@dataclass
class CheckResult:
    exercise: str
    passed: bool
    message: str

    def __bool__(self) -> bool:
        return self.passed

    def __repr__(self) -> str:
        return f"CheckResult(exercise={self.exercise!r}, passed={self.passed})"


def strict_mode() -> bool:
    env = os.environ
    return env.get("LABKIT_STRICT_CHECKS") == "1" or env.get("LABKIT_INJECT_SOLUTIONS") == "1"


def run_check(exercise: str, body: Callable[[], str], *, record: bool = True,
              quiet: bool = False) -> CheckResult:
    """Run a checker body; it returns a celebration line or raises ``CheckFailure``."""
    attempted = True
    try:
        message = "✓ " + exercise + ": " + body()
        passed = True
    except CheckFailure as f:
        message, passed = "✗ " + exercise + ": " + f.report(), False
    except NotImplementedError as e:  # the untouched stub: not an attempt (progress says so)
        todo = str(e) or "replace the `raise NotImplementedError` with your code"
        message = f"· {exercise}: not implemented yet — {todo} and run the check again."
        passed = attempted = False
    result = CheckResult(exercise, passed, message)
    if record:
        progress.record(exercise, passed, attempted=attempted)
    if not quiet:
        print(message)
    if strict_mode() and not passed:
        raise AssertionError(message)
    return result


def call(fn: Callable[..., Any], *args: Any, _label: str | None = None, **kwargs: Any) -> Any:
    """Call learner code; an exception becomes a CheckFailure naming the input that caused it."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise
    except Exception as e:  # noqa: BLE001 - any learner crash is reported with its input
        tb = traceback.extract_tb(e.__traceback__)
        where = f" (at line {tb[-1].lineno}: {tb[-1].line})" if tb else ""
        raise CheckFailure(
            f"your function raised {type(e).__name__}: {e}{where}",
            inputs=_label or signature(getattr(fn, "__name__", "fn"), args, kwargs),
            show_values=False,
            hint="the reference handles this input; read the contract in the docstring again.",
        ) from e


def signature(name: str, args: tuple, kwargs: dict) -> str:
    parts = [short(a, 60) for a in args] + [f"{k}={short(v, 60)}" for k, v in kwargs.items()]
    return f"{name}({', '.join(parts)})"


def short(value: Any, limit: int = 300) -> str:
    """repr trimmed for reports; tensors show shape, dtype and a few values."""
    if isinstance(value, torch.Tensor):
        flat = value.detach().flatten()
        head = flat[:8].tolist()
        more = ", …" if flat.numel() > 8 else ""
        return f"tensor(shape={list(value.shape)}, dtype={value.dtype}, values={head}{more})"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def ready(*results: CheckResult, then: str) -> bool:
    """Gate for a cell that builds on earlier checks: True when all passed, else it says why
    the cell does nothing (a silent cell looks like a broken one)."""
    waiting = [r.exercise for r in results if not r]
    if waiting:
        print(f"· skipped: {then} runs once {' and '.join(waiting)} "
              f"{'passes' if len(waiting) == 1 else 'pass'} (see the check above).")
    return not waiting

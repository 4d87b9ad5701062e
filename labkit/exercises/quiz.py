"""The "Check yourself" questions of notebooks 00-06: the learner answers, labkit checks.

An answer cell ships as ``my_answer_q1 = None``, so the solution is not on the page before the
learner has thought about it, and the next cell calls ``check_answer`` with the truth labkit
computes there. A plain ``assert`` would stop "Run all" at the first wrong or unanswered
question; ``check_answer`` reports "✎" (not answered), "✓" or "✗" and carries on. In CI
(``LABKIT_INJECT_SOLUTIONS=1``, which also turns on strict mode) the truth stands in for the
missing answer, so the right-answer path runs, and any failed comparison raises: a broken check
fails the build instead of rotting.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any

from labkit.exercises.checks import CheckFailure, CheckResult, run_check, short


class QuizResult(CheckResult):
    """A ``CheckResult`` that Jupyter does not echo: the check cell ends with the call, and its
    report is already printed, so a ``CheckResult(...)`` repr below it would only be noise."""

    def _ipython_display_(self) -> None:
        pass


def _plain(value: Any) -> Any:
    """0-d tensors / numpy scalars -> Python scalars, so ``int(...)``-less answers compare too."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        return value.item()
    return value


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "True/False"
    if isinstance(value, numbers.Number):
        return "a number"
    if isinstance(value, str):
        return "a string"
    return type(value).__name__


def answers_match(answer: Any, truth: Any, *, rel_tol: float = 1e-3,
                  abs_tol: float = 0.0) -> bool:
    """Equality as a person means it: a float truth within a tolerance (an answer rounded to
    about three significant digits passes), an int truth exactly, strings stripped and
    case-insensitive, True/False only as bools."""
    answer, truth = _plain(answer), _plain(truth)
    if isinstance(truth, str) and isinstance(answer, str):
        return answer.strip().casefold() == truth.strip().casefold()
    if isinstance(truth, bool) or isinstance(answer, bool):
        return isinstance(truth, bool) and isinstance(answer, bool) and answer == truth
    if isinstance(answer, numbers.Real) and isinstance(truth, numbers.Real):
        if isinstance(truth, numbers.Integral):  # a count: 2.0 is fine, 8.9e6 for 8,912,896 not
            return answer == truth
        return math.isclose(float(answer), float(truth), rel_tol=rel_tol, abs_tol=abs_tol)
    try:
        return bool(answer == truth)
    except Exception:  # noqa: BLE001 - e.g. a multi-element tensor: simply not the answer
        return False


def check_answer(question: str, answer: Any, truth: Any, *, why: str, explain: str = "",
                 rel_tol: float = 1e-3, abs_tol: float = 0.0) -> QuizResult:
    """Check a learner's ``answer`` to ``question`` against ``truth`` (computed by labkit).

    ``None`` means not answered yet: a reminder, no error (in CI the truth is used instead).
    Right prints "✓" and ``explain``; wrong prints "✗", expected vs given and the ``why`` hint.
    Never raises for a wrong answer unless strict mode is on (``LABKIT_STRICT_CHECKS=1`` or
    ``LABKIT_INJECT_SOLUTIONS=1``), so "Run all" reaches every question.
    """
    if answer is None:
        if os.environ.get("LABKIT_INJECT_SOLUTIONS") != "1":
            message = (f"✎ {question} not answered yet: edit the cell above (replace None with "
                       "your answer) and run both cells again.")
            print(message)
            return QuizResult(question, False, message)
        answer = truth

    def body() -> str:
        if not answers_match(answer, truth, rel_tol=rel_tol, abs_tol=abs_tol):
            what = "not what labkit computes"
            if _kind(answer) != _kind(truth):
                what += f" (expected {_kind(truth)}, you gave {_kind(answer)}: {short(answer, 60)})"
            raise CheckFailure(what, expected=truth, actual=answer, hint=why)
        return "correct" + (f" — {explain}" if explain else "")

    result = run_check(question, body, record=False)
    return QuizResult(result.exercise, result.passed, result.message)

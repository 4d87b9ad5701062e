"""Swap in the reference solution when CI runs the exercise notebooks.

Notebooks call ``inject(name, learner_fn)`` right after the learner's cell. With
``LABKIT_INJECT_SOLUTIONS=1`` (CI) it returns the reference from ``labkit.exercises.solutions``,
so every checker runs against a right answer on every commit and the notebooks cannot silently
rot; otherwise it returns the learner's own function. This is the only module that reads the
solutions: the checkers take their references from labkit itself.
"""

from __future__ import annotations

import importlib
import os
from typing import Any


def inject(name: str, learner_fn: Any, module: str = "solutions") -> Any:
    """The reference ``name`` under ``LABKIT_INJECT_SOLUTIONS=1``, else ``learner_fn``.
    ``module``: the ``labkit.exercises`` module holding it (newer exercises keep their own)."""
    if os.environ.get("LABKIT_INJECT_SOLUTIONS") != "1":
        return learner_fn
    if module == "solutions":  # lazy: spoilers stay unread unless injecting
        from labkit.exercises import solutions
    else:  # e.g. "tp_attention_solutions": nothing else imports those either
        solutions = importlib.import_module(f"labkit.exercises.{module}")
    if not hasattr(solutions, name):
        raise ValueError(f"no reference solution named {name!r} in labkit.exercises.{module}")
    return getattr(solutions, name)

"""Sources."""

from labkit.exercises.drills_core import Claim

SOURCES: dict[str, list[Claim]] = {}

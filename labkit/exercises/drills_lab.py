"""Which drills the lab answers with a measured experiment: the command to run, and where the
notebook walks through it. ``labkit drill`` prints it after the answer ("measure it:"), so a
learner who just read "MIG isolates tenants" can see it happen on the simulator and this CPU.
Data only; tests/exercises/test_drills.py checks every command names a registered experiment."""

from __future__ import annotations

NB17 = "notebooks/17_operating_the_service.ipynb"

# drill id -> (command, where the notebook explains it)
EXPERIMENTS: dict[str, tuple[str, str]] = {
    "mig": ("labkit bench ops isolation", f"{NB17} §1"),
    "tenants": ("labkit bench ops noisy-neighbour", f"{NB17} §2"),
    "gateway": ("labkit bench ops gateway", f"{NB17} §3"),
    "rate-limit": ("labkit bench ops gateway", f"{NB17} §3"),
    "tail-latency": ("labkit bench ops length-routing", f"{NB17} §4"),
    "cold-start": ("labkit bench ops cold-start", f"{NB17} §5"),
    "hot-update": ("labkit bench ops hot-swap", f"{NB17} §6"),
    "canary": ("labkit bench ops hot-swap", f"{NB17} §6 (blue/green)"),
    "sse": ("labkit bench ops cancel", f"{NB17} §8"),
}


def measure_line(drill_id: str, lang: str = "en") -> str | None:
    """``measure it: COMMAND (NOTEBOOK §N)`` for a drill the lab measures, else None."""
    if drill_id not in EXPERIMENTS:
        return None
    cmd, where = EXPERIMENTS[drill_id]
    return f"{'动手测' if lang == 'zh' else 'measure it'}: {cmd} ({where})"

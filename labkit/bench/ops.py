"""``labkit bench ops NAME``: the experiments of operating the service (issue 34), one per name.

    labkit bench ops --list
    labkit bench ops length-routing --quick --json F
    labkit bench ops hot-swap --quick --json F
    labkit bench ops cancel --quick --json F

Each experiment is its own module with the usual ``--quick`` / ``--json`` flags; this one only
lists them and hands the rest of the command line over.
"""

from __future__ import annotations

import importlib

EXPERIMENTS = {  # name -> module with main(argv)
    "length-routing": "labkit.bench.ops_length",
    "isolation": "labkit.bench.ops_isolation",
    "noisy-neighbour": "labkit.bench.ops_noisy",
    "hot-swap": "labkit.bench.ops_hot_swap",
    "cold-start": "labkit.bench.ops_coldstart",
    "cpu-tuning": "labkit.bench.ops_cpu",
    "gateway": "labkit.bench.ops_gateway",
    "cancel": "labkit.bench.ops_cancel",
}


def describe() -> list[str]:
    """``name: first docstring line`` of every experiment."""
    out = []
    for name, mod in EXPERIMENTS.items():
        doc = (importlib.import_module(mod).__doc__ or "").strip().splitlines()
        out.append(f"{name}: {doc[0].split(': ', 1)[-1] if doc else ''}")
    return out


def main(argv: list[str] | None = None) -> int:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("--list", "-h", "--help"):
        print("labkit bench ops NAME [--quick] [--json F]; experiments:")
        print("\n".join("  " + line for line in describe()))
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in EXPERIMENTS:
        print(f"unknown experiment {name!r}; valid: {', '.join(EXPERIMENTS)}", file=sys.stderr)
        return 2
    return importlib.import_module(EXPERIMENTS[name]).main(rest)

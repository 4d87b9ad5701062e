"""Small helpers every benchmark shares: an argument parser, a table printer, a JSON writer."""

from __future__ import annotations

import argparse
import json
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from labkit.paths import RESULTS_DIR


def bench_parser(name: str, description: str) -> argparse.ArgumentParser:
    """The flags every ``labkit bench NAME`` accepts: ``--quick`` and ``--json PATH``."""
    p = argparse.ArgumentParser(prog=f"labkit bench {name}", description=description)
    p.add_argument("--quick", action="store_true", help="small sizes, finishes in about a minute")
    p.add_argument("--json", metavar="PATH", help="write the results as JSON to PATH")
    return p


def environment() -> dict[str, Any]:
    """Where the numbers came from: always stored beside results."""
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "machine": platform.machine(),
        "processor": platform.processor() or platform.machine(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "threads": torch.get_num_threads(),
    }


def print_table(rows: Sequence[dict[str, Any]], columns: Sequence[str] | None = None) -> None:
    """Print rows of dicts as an aligned text table (floats to 4 significant digits)."""
    if not rows:
        print("(no rows)")
        return
    cols = list(columns or rows[0].keys())

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.4g}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def write_json(path: str | Path | None, payload: dict[str, Any]) -> None:
    """Write ``payload`` (plus the environment) to ``path`` if one was given."""
    if not path:
        return
    payload = {**payload, "environment": payload.get("environment", environment())}
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(payload, indent=2, default=float) + "\n")
    print(f"wrote {p}")


def load_result(name: str) -> dict[str, Any]:
    """A committed benchmark result, ``datasets/results/<name>.json`` (what the README quotes),
    so notebooks can print it beside the learner's own run."""
    path = RESULTS_DIR / f"{name}.json"
    if not path.exists():
        known = sorted(p.stem for p in RESULTS_DIR.glob("*.json"))
        raise FileNotFoundError(f"no committed result {name!r} in {RESULTS_DIR}; known: {known}")
    return json.loads(path.read_text())

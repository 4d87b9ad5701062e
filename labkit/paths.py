"""Where the lab's files live: the repository root and its datasets/ folder.

One place for the path arithmetic, so moving a module never silently points a loader at the
wrong folder. ``labkit`` is installed editable from the repository (``pip install -e .``), so
the root is the parent of this package.
"""

from __future__ import annotations

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
DATASETS_DIR = REPO_ROOT / "datasets"  # models/, workloads/, results/
RESULTS_DIR = DATASETS_DIR / "results"  # benchmark results worth keeping

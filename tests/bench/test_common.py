"""labkit.bench.common.load_result: the committed results notebooks print beside a learner's run."""

import json
from pathlib import Path

import pytest

from labkit.bench.common import load_result

RESULTS = Path(__file__).resolve().parents[2] / "datasets" / "results"


def test_load_result_reads_the_committed_json():
    assert load_result("memory") == json.loads((RESULTS / "memory.json").read_text())


def test_load_result_names_the_known_results():
    with pytest.raises(FileNotFoundError, match="'memory'"):
        load_result("no-such-bench")

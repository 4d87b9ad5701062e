"""Every committed result says where it came from, and the README says it too (issue 27).

A number measured while other work ran (``serve_llamacpp.json`` at load 15.8, ``gguf.json``
with labkit decoding at 23 tokens/s instead of about 465) is not a claim. Each result records its
machine and, since stop 25, the load average at the start and end of its run
(``labkit.bench.common.environment``); the README's table "Where each number comes from" lists
every file with that load, and marks a run over the bar (1-minute load at start >= cores) busy.
"""

from __future__ import annotations

import json
import re

import pytest

from labkit.bench import common
from labkit.paths import REPO_ROOT, RESULTS_DIR

README = REPO_ROOT / "README.md"


def _table(heading: str) -> list[list[str]]:
    text = README.read_text()
    block = text.split(heading, 1)[1].split("\n\n|", 1)[1].split("\n\n", 1)[0]
    rows = ["|" + block.split("\n", 1)[0]] + block.split("\n")[1:]
    return [[c.strip() for c in r.strip().strip("|").split("|")] for r in rows[2:]]


def _provenance() -> dict[str, list[str]]:
    rows = _table("### Where each number comes from")
    names = [r[0].strip("`") for r in rows]
    assert len(names) == len(set(names)), "a result is listed twice"
    return {r[0].strip("`"): r for r in rows}


def recorded_load(d: dict) -> tuple[float, str] | None:
    """(1-minute load, when) a result recorded, in any of the forms the lab has written."""
    env = d.get("environment") or {}
    if env.get("load_average_at_start"):
        return float(env["load_average_at_start"][0]), "start"
    if d.get("load_average"):  # serve_llamacpp.json, before environment() recorded it
        return float(d["load_average"][0]), "start"
    if env.get("loadavg_1m_at_end") is not None:  # gguf.json
        return float(env["loadavg_1m_at_end"]), "end"
    return None


def _cores(d: dict) -> int:
    env = d.get("environment") or {}
    return int(env.get("cores") or env.get("cpus") or 2)  # the lab's machines: 2 cores


def test_every_result_is_listed_with_the_load_it_recorded():
    table = _provenance()
    files = sorted(p.name for p in RESULTS_DIR.glob("*.json"))
    assert sorted(table) == files, "README's provenance table and datasets/results/ differ"
    for name in files:
        d = json.loads((RESULTS_DIR / name).read_text())
        load, note = table[name][3], table[name][4]
        got = recorded_load(d) if isinstance(d, dict) else None
        if got is None:
            assert load == "not recorded", (name, load)
            continue
        value, when = got
        want = f"{value:.2f}" + ("" if when == "start" else " (at end)")
        assert load == want, (name, load, want)
        busy = value >= _cores(d)
        assert busy == ("**busy**" in note), f"{name}: load {value} on {_cores(d)} cores"


def test_new_results_record_their_machine_and_load():
    common.mark_start()
    env = common.environment()
    assert env["cores"] >= 1 and env["cpu_model"]
    assert len(env["load_average_at_start"]) == 3 and len(env["load_average_at_end"]) == 3
    assert env["run_s"] >= 0
    for name in sorted(p.name for p in RESULTS_DIR.glob("*.json")):
        d = json.loads((RESULTS_DIR / name).read_text())
        e = d.get("environment") if isinstance(d, dict) else None
        if e and "cpu_model" in e:  # written since stop 25: the whole record is there
            assert e["load_average_at_start"] and e["cores"], name


def test_claims_table_names_a_listed_run_and_says_when_it_was_busy():
    table = _provenance()
    for row in _table("## The field's headline claims, measured"):
        run = row[4]
        files = re.findall(r"`([\w.-]+\.json)`", run)
        assert files, f"claim {row[0]} names no run"
        for f in files:
            assert f in table, f
            if "**busy**" in table[f][4]:
                assert "busy" in run, f"claim {row[0]} quotes a busy run without saying so"
            if table[f][3] == "not recorded":
                assert "not recorded" in run, row[0]


@pytest.mark.parametrize("payload,want", [
    ({"environment": {"load_average_at_start": [0.4, 1, 1]}}, (0.4, "start")),
    ({"load_average": [15.8, 14, 12], "environment": {}}, (15.8, "start")),
    ({"environment": {"loadavg_1m_at_end": 3.5}}, (3.5, "end")),
    ({"environment": {}}, None)])
def test_recorded_load_reads_every_form(payload, want):
    assert recorded_load(payload) == want


def failed_checks(d: dict) -> list[str]:
    """Top-level boolean checks of a result (``outputs_match``, ``kv_bytes_match_formula``,
    any ``*match*`` key) that are False."""
    return sorted(k for k, v in d.items() if "match" in k and v is False)


def test_no_committed_result_failed_its_own_checks():
    """A run whose own equality check failed (outputs differ, bytes off the formula) measured
    something broken: it is not a result to commit."""
    bad = {p.name: failed_checks(json.loads(p.read_text()))
           for p in sorted(RESULTS_DIR.glob("*.json"))}
    assert not {k: v for k, v in bad.items() if v}
    assert failed_checks({"outputs_match": False, "ep_bytes_match_formula": True,
                          "speedup": 2.0}) == ["outputs_match"]  # the check can fail

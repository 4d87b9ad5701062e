"""Corpus: fixed order, documented exclusions, a split that never moves, a stable fingerprint."""

from __future__ import annotations

import hashlib

import pytest

from labkit.train.corpus import (
    TOPICS_PREFIX,
    build_corpus,
    is_heldout,
    list_sources,
    stdlib_root,
)


def _fake_stdlib(root):
    (root / "pkg").mkdir(parents=True)
    (root / "site-packages" / "thirdparty").mkdir(parents=True)
    (root / "pkg" / "__pycache__").mkdir()
    (root / "pydoc_data").mkdir()
    (root / "b.py").write_text("def b():\n\treturn 'b'\n")
    (root / "a.py").write_text("import os\n\n\nclass A:\n    pass\n")
    (root / "pkg" / "mod.py").write_text("x = 1  # trailing spaces   \r\n")
    (root / "pkg" / "notes.txt").write_text("not python")
    (root / "site-packages" / "thirdparty" / "x.py").write_text("third = 'party'\n")
    (root / "pkg" / "__pycache__" / "mod.py").write_text("cached = True\n")
    (root / "pydoc_data" / "topics.py").write_text("topics = {}\n")
    (root / "latin.py").write_bytes("# coding: latin-1\nname = 'caf\xe9'\n".encode("latin-1"))
    return root


def test_sources_sorted_with_documented_exclusions(tmp_path):
    root = _fake_stdlib(tmp_path / "lib")
    assert list_sources(root) == ["a.py", "b.py", "latin.py", "pkg/mod.py"]


def test_build_corpus_reads_exact_bytes_and_skips_non_utf8(tmp_path):
    root = _fake_stdlib(tmp_path / "lib")
    c = build_corpus(root=root, with_topics=False)
    docs = {d.name: d.text for d in c.train + c.heldout}
    assert set(docs) == {"a.py", "b.py", "pkg/mod.py"}
    assert docs["pkg/mod.py"] == "x = 1  # trailing spaces   \r\n"  # no newline translation
    assert c.skipped == ["latin.py"]


def test_heldout_rule_is_sha256_of_the_name():
    names = [f"pkg/mod_{i}.py" for i in range(2000)]
    for n in names[:200]:
        h = int(hashlib.sha256(n.encode()).hexdigest()[:16], 16)
        assert is_heldout(n) == (h < 0.02 * 2**64)
    frac = sum(map(is_heldout, names)) / len(names)
    assert 0.01 < frac < 0.03  # Binomial(2000, 0.02): sd 0.003
    with pytest.raises(ValueError, match="fraction"):
        is_heldout("a.py", 1.5)


def test_split_of_a_file_ignores_the_other_files(tmp_path):
    root = _fake_stdlib(tmp_path / "lib")
    before = build_corpus(root=root, with_topics=False, heldout_fraction=0.5)
    for i in range(30):
        (root / f"new_{i}.py").write_text(f"n = {i}\n")
    after = build_corpus(root=root, with_topics=False, heldout_fraction=0.5)
    split = {d.name: s for s, docs in (("t", after.train), ("h", after.heldout)) for d in docs}
    for s, docs in (("t", before.train), ("h", before.heldout)):
        assert all(split[d.name] == s for d in docs)
    assert before.fingerprint != after.fingerprint


def test_real_stdlib_corpus_is_deterministic():
    a, b = build_corpus(), build_corpus()
    assert a.fingerprint == b.fingerprint
    names = [d.name for d in a.train if not d.name.startswith(TOPICS_PREFIX)]
    assert names == sorted(names)
    assert any(d.name.startswith(TOPICS_PREFIX) for d in a.train + a.heldout)
    assert "pydoc_data/topics.py" not in names
    # The split the shipped models were trained with (it must never move).
    held = {d.name for d in a.heldout}
    assert {"sched.py", "copyreg.py", "multiprocessing/connection.py"} <= held
    assert "json/__init__.py" not in held and "os.py" not in held
    n = len(a.train) + len(a.heldout)
    assert 0.01 * n < len(a.heldout) < 0.04 * n


def test_missing_root_and_empty_selection_are_named_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        list_sources(tmp_path / "nope")
    with pytest.raises(ValueError, match="start with"):
        build_corpus(root=stdlib_root(), include=["no_such_module_prefix/"])

"""The training corpus: text every Python install already has, rebuilt the same way every time.

labkit cannot download data at run time, so its tiny models learn from the running Python's
standard library: every ``.py`` source under ``sysconfig``'s stdlib directory plus the prose help
topics of ``pydoc_data.topics``. The corpus is never committed; it is rebuilt on demand and is a
pure function of the Python installation:

* Files are listed in sorted order of their relative POSIX path (no directory-walk order leaks in).
* Excluded, by rule and never at random: ``site-packages``/``dist-packages`` (not the standard
  library), ``__pycache__``, and ``pydoc_data/topics.py`` itself (a 750 kB generated file holding
  the help topics as string literals; we add those topics as plain-text documents instead, so the
  model reads prose, not escaped Python strings). Files that are not valid UTF-8 (a few test
  fixtures deliberately use other encodings) are skipped and counted in ``Corpus.skipped``.
* The held-out split is chosen by hashing each document's name (sha256 of the relative path), so
  a file's split never changes when other files come or go, and it is the same on every machine.
"""

from __future__ import annotations

import hashlib
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

HELDOUT_FRACTION = 0.02
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__"})
EXCLUDED_FILES = frozenset({"pydoc_data/topics.py"})
TOPICS_PREFIX = "pydoc_data.topics/"


@dataclass(frozen=True)
class Document:
    name: str  # relative POSIX path, or "pydoc_data.topics/<topic>"
    text: str


@dataclass
class Corpus:
    train: list[Document]
    heldout: list[Document]
    skipped: list[str] = field(default_factory=list)  # names not decodable as UTF-8

    @property
    def fingerprint(self) -> str:
        """sha256 over every document's split, name and text: equal iff the corpora are equal."""
        h = hashlib.sha256()
        for split, docs in (("train", self.train), ("heldout", self.heldout)):
            for d in docs:
                for part in (split, d.name, d.text):
                    b = part.encode("utf-8")
                    h.update(len(b).to_bytes(8, "little"))
                    h.update(b)
        return h.hexdigest()

    def stats(self) -> dict[str, int]:
        return {
            "train_documents": len(self.train),
            "heldout_documents": len(self.heldout),
            "train_chars": sum(len(d.text) for d in self.train),
            "heldout_chars": sum(len(d.text) for d in self.heldout),
            "skipped_non_utf8": len(self.skipped),
        }


def stdlib_root() -> Path:
    """Directory of the running interpreter's standard library sources."""
    return Path(sysconfig.get_paths()["stdlib"])


def is_heldout(name: str, fraction: float = HELDOUT_FRACTION) -> bool:
    """Stable split: the first 8 bytes of sha256(name) as a number in [0, 1) below `fraction`."""
    if not 0.0 <= fraction < 1.0:
        raise ValueError(f"held-out fraction must be in [0, 1), got {fraction}")
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def list_sources(root: Path | None = None) -> list[str]:
    """Sorted relative paths of the stdlib's ``.py`` files, after the documented exclusions."""
    root = Path(root) if root is not None else stdlib_root()
    if not root.is_dir():
        raise ValueError(f"standard library directory {root} does not exist")
    names = []
    for p in root.rglob("*.py"):
        rel = p.relative_to(root)
        if EXCLUDED_DIRS.intersection(rel.parts[:-1]) or not p.is_file():
            continue
        name = rel.as_posix()
        if name not in EXCLUDED_FILES:
            names.append(name)
    return sorted(names)


def topic_documents() -> list[Document]:
    """The interactive help topics (``help('if')``, ...) as plain text, in sorted key order."""
    from pydoc_data.topics import topics

    return [Document(TOPICS_PREFIX + k, topics[k]) for k in sorted(topics)]


def build_corpus(root: Path | None = None, include: Sequence[str] | None = None,
                 with_topics: bool = True,
                 heldout_fraction: float = HELDOUT_FRACTION) -> Corpus:
    """Read the corpus. `include` keeps only sources whose path starts with one of the prefixes
    (used for the quick smoke run and tests); the full corpus passes None."""
    root = Path(root) if root is not None else stdlib_root()
    names = list_sources(root)
    if include is not None:
        names = [n for n in names if n.startswith(tuple(include))]
        if not names:
            raise ValueError(f"no stdlib sources under {root} start with {list(include)}")
    docs, skipped = [], []
    for name in names:
        try:
            docs.append(Document(name, (root / name).read_bytes().decode("utf-8")))
        except UnicodeDecodeError:
            skipped.append(name)
    if with_topics:
        docs += topic_documents()
    train = [d for d in docs if not is_heldout(d.name, heldout_fraction)]
    heldout = [d for d in docs if is_heldout(d.name, heldout_fraction)]
    return Corpus(train=train, heldout=heldout, skipped=skipped)

"""Style slices of the stdlib for LoRA fine-tuning: the same text the base model learned from,
cut by a stated rule into three kinds of Python an adapter can pull the model toward.

Every slice is a list of *functions* (their source, as ``ast.get_source_segment`` returns it,
dedented), picked from the running Python's standard library (:mod:`labkit.train.corpus`):

* ``docstring``: functions outside the test suite whose body starts with a docstring;
* ``tests``: ``test*`` methods of classes in the test suites' ``test_*.py`` files: ``unittest``
  code, ``self.assertEqual`` and friends (module-level ``test*`` functions are left out: in
  the stdlib they are mostly doctests, docstring text rather than test code).

(A third style, type-hinted code, was tried and dropped: Python 3.11's stdlib has only ~100
fully annotated functions outside the tests, too few for a train / held-out split by file.)

Why functions and not whole files: a file mixes the styles (a typed module still has untyped
helpers), and an adapter learns what its data shows; a function is the smallest unit that has a
style. Files are visited in order of ``sha256(path)`` (a stable order that is not alphabetical,
so a slice is not all ``asyncio``), and a slice stops once it has ``max_chars`` of text, so
building one reads only the files it needs. The held-out split is by *file*
(:func:`~labkit.train.corpus.is_heldout` with :data:`HELDOUT_FRACTION`): no function of a
held-out file is trained on, so held-out loss measures the style, not memorised code.
"""

from __future__ import annotations

import ast
import hashlib
import textwrap
from dataclasses import dataclass
from pathlib import Path

import torch

from labkit.train.corpus import HELDOUT_FRACTION, is_heldout, list_sources, stdlib_root

STYLES = ("docstring", "tests")


@dataclass
class StyleSlice:
    """One style's functions, split by file; ``files`` lists the source files used."""

    style: str
    train: list[str]
    heldout: list[str]
    train_files: list[str]
    heldout_files: list[str]

    def stats(self) -> dict[str, int]:
        return {"train_functions": len(self.train), "heldout_functions": len(self.heldout),
                "train_chars": sum(map(len, self.train)),
                "heldout_chars": sum(map(len, self.heldout)),
                "train_files": len(self.train_files), "heldout_files": len(self.heldout_files)}


def is_test_file(name: str) -> bool:
    """A file of the stdlib's test suites: under a ``test`` / ``tests`` / ``*_test`` folder
    (``test/``, ``ctypes/test/``, ``idlelib/idle_test/``) or named ``test_*.py``."""
    *dirs, base = name.split("/")
    return base.startswith("test_") or any(d in ("test", "tests") or d.endswith("_test")
                                           for d in dirs)


def matches(style: str, node: ast.AST, test_file: bool, in_class: bool) -> bool:
    """The rule of :data:`STYLES` for one AST node of a file (``in_class``: a method)."""
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return False
    if style == "tests":
        return test_file and in_class and node.name.startswith("test")
    if test_file:
        return False
    if style == "docstring":
        return ast.get_docstring(node) is not None
    raise ValueError(f"unknown style {style!r}; choose one of {STYLES}")


def _candidate_files(style: str, root: Path) -> list[str]:
    names = list_sources(root)
    if style == "tests":
        names = [n for n in names if is_test_file(n) and n.rsplit("/", 1)[-1].startswith("test_")]
    else:
        names = [n for n in names if not is_test_file(n)]
    return sorted(names, key=lambda n: hashlib.sha256(n.encode()).hexdigest())


def _functions(style: str, src: str, test_file: bool, max_len: int) -> list[str]:
    try:
        tree = ast.parse(src)
    except (SyntaxError, ValueError):  # a few test fixtures are deliberately invalid
        return []
    methods = {id(n) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for n in c.body}
    out = []
    for node in ast.walk(tree):
        if matches(style, node, test_file, id(node) in methods):
            seg = ast.get_source_segment(src, node)
            if seg and len(seg) <= max_len:
                out.append(textwrap.dedent(" " * node.col_offset + seg))
    return out


def build_slice(style: str, max_chars: int = 400_000, heldout_chars: int = 40_000,
                root: Path | None = None, max_function_chars: int = 3000) -> StyleSlice:
    """The ``style`` slice: functions by the rule above, up to ``max_chars`` of training text
    and ``heldout_chars`` of held-out text (functions longer than ``max_function_chars`` are
    skipped: one huge function would dominate a small slice)."""
    if style not in STYLES:
        raise ValueError(f"unknown style {style!r}; choose one of {STYLES}")
    root = Path(root) if root is not None else stdlib_root()
    s = StyleSlice(style, [], [], [], [])
    have = {"train": 0, "heldout": 0}
    cap = {"train": max_chars, "heldout": heldout_chars}
    for name in _candidate_files(style, root):
        split = "heldout" if is_heldout(name, HELDOUT_FRACTION) else "train"
        if have[split] >= cap[split]:
            if all(have[k] >= cap[k] for k in cap):
                break
            continue
        try:
            src = (root / name).read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue
        funcs = _functions(style, src, is_test_file(name), max_function_chars)
        if not funcs:
            continue
        getattr(s, split).extend(funcs)
        getattr(s, f"{split}_files").append(name)
        have[split] += sum(map(len, funcs))
    if not s.train or not s.heldout:
        raise ValueError(f"the {style!r} slice of {root} is empty (train {len(s.train)}, "
                         f"held-out {len(s.heldout)} functions)")
    return s


def slice_token_ids(tok, s: StyleSlice) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) id streams, ``EOT fn EOT fn ... EOT`` as :mod:`labkit.train.data`
    builds the pre-training streams, so the adapter sees the layout the base was trained on."""
    from labkit.train.corpus import Document
    from labkit.train.data import encode_documents

    def ids(texts: list[str]) -> torch.Tensor:
        docs = [Document(f"{s.style}/{i}", t) for i, t in enumerate(texts)]
        return torch.from_numpy(encode_documents(tok, docs).astype("int64"))

    return ids(s.train), ids(s.heldout)

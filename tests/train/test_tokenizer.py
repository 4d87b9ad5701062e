"""Byte-level BPE: exact round-trips on real stdlib code, BOS prepended, transformers agrees."""

from __future__ import annotations

from pathlib import Path

import pytest

from labkit.model.tokenizer import Tokenizer
from labkit.train.corpus import build_corpus, list_sources, stdlib_root
from labkit.train.tokenizer import (
    EOT,
    EOT_ID,
    load_tokenizer,
    save_tokenizer,
    tokenizer_hash,
    train_tokenizer,
)

SHIPPED = Path(__file__).resolve().parents[2] / "datasets" / "models" / "labkit-tiny"
TRICKY = [
    "def f(x):\n\tif x:\n\t\treturn  x  \n    \n",  # tabs, double and trailing spaces
    "a = 1\r\nb = 2\r\n",  # CRLF
    "s = 'café – 日本語 🐍'\n",  # multi-byte UTF-8
    "\n\n\n        \n",  # whitespace only
    "x , y ( z ) . w",  # spaces before punctuation (transformers' clean-up would eat them)
]


def _sample_sources(every: int = 60) -> list[str]:
    root = stdlib_root()
    names = list_sources(root)[::every]
    out = []
    for n in names:
        try:
            out.append((root / n).read_text(encoding="utf-8"))
        except UnicodeDecodeError:
            continue
    return out


@pytest.fixture(scope="module")
def shipped() -> Tokenizer:
    if not (SHIPPED / "tokenizer.json").is_file():
        pytest.skip("shipped labkit-tiny is not in datasets/models")
    return Tokenizer.from_dir(SHIPPED)


def test_shipped_tokenizer_round_trips_stdlib_sources_exactly(shipped):
    texts = _sample_sources()
    assert len(texts) > 20
    for text in texts + TRICKY:
        ids = shipped.encode(text)
        assert ids[0] == EOT_ID and EOT_ID not in ids[1:]
        assert shipped.decode(ids) == text
    assert shipped.bos_token_id == shipped.eos_token_id == EOT_ID
    assert shipped.vocab_size == 4096


def test_shipped_tokenizer_compresses_code(shipped):
    text = "".join(_sample_sources(every=120))
    # byte-level BPE with 4k merges on code: well above 2 bytes per token
    assert len(text.encode()) / len(shipped.encode(text)) > 2.5


def test_trained_tokenizer_is_deterministic_and_exact(tmp_path):
    docs = [d.text for d in build_corpus(include=["json/", "sched.py"], with_topics=False).train]
    a = train_tokenizer(docs, vocab_size=400)
    b = train_tokenizer(docs, vocab_size=400)
    assert tokenizer_hash(a) == tokenizer_hash(b)
    assert a.get_vocab_size() == 400 and a.token_to_id(EOT) == EOT_ID
    save_tokenizer(a, tmp_path)
    tok = load_tokenizer(tmp_path)
    for text in docs + TRICKY:
        ids = tok.encode(text).ids
        assert ids[0] == EOT_ID
        assert tok.decode(ids, skip_special_tokens=True) == text
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(docs, vocab_size=100)
    with pytest.raises(ValueError, match="no tokenizer.json"):
        load_tokenizer(tmp_path / "missing")


def test_transformers_autotokenizer_matches(shipped):
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(SHIPPED))
    assert hf.is_fast
    assert hf.bos_token_id == hf.eos_token_id == EOT_ID
    for text in TRICKY + _sample_sources(every=200):
        ids = shipped.encode(text)
        assert hf(text)["input_ids"] == ids
        assert hf.decode(ids, skip_special_tokens=True) == text

"""Prepared training data: the corpus encoded once into token-id streams, cached on disk.

A prepared-data directory holds everything training needs and nothing it has to recompute:

    tokenizer.json, tokenizer_config.json   the tokenizer the ids were made with
    tokens.npz                              `train` and `heldout` uint16 id streams
    meta.json                               Python version, corpus fingerprint and statistics,
                                            tokenizer sha256

Each stream is ``EOT doc EOT doc ... EOT``: every document starts with the end-of-text token
(exactly what encoding a prompt yields, since the post-processor prepends it as BOS) and the
last one is closed by it too. The cache lives under ``.cache/labkit-train/`` keyed by the
Python version, the corpus fingerprint and the tokenizer's hash, so a stale cache is never used.
Because the directory is self-contained, it can be copied to another machine (a GPU box with a
different Python) and that machine trains on exactly this corpus.
"""

from __future__ import annotations

import json
import platform
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from labkit.train.corpus import Corpus, Document, build_corpus
from labkit.train.tokenizer import (
    EOT_ID,
    load_tokenizer,
    save_tokenizer,
    tokenizer_hash,
    train_tokenizer,
)

DEFAULT_CACHE = Path(".cache") / "labkit-train"


@dataclass
class TokenData:
    train: torch.Tensor  # int64 [N] id stream
    heldout: torch.Tensor
    meta: dict
    path: Path


def encode_documents(tok, docs: Sequence[Document]) -> np.ndarray:
    """EOT-separated id stream; the tokenizer's post-processor supplies each leading EOT."""
    if tok.get_vocab_size() > np.iinfo(np.uint16).max:
        raise ValueError("vocabulary too large for uint16 token storage")
    parts = [np.asarray(e.ids, dtype=np.uint16)
             for e in tok.encode_batch([d.text for d in docs])]
    parts.append(np.asarray([EOT_ID], dtype=np.uint16))
    return np.concatenate(parts)


def prepare_data(include: Sequence[str] | None = None, vocab_size: int = 4096,
                 tokenizer_dir: str | Path | None = None, cache_root: str | Path = DEFAULT_CACHE,
                 max_length: int = 1024, corpus: Corpus | None = None) -> Path:
    """Build (or reuse from cache) a prepared-data directory and return its path.

    Without `tokenizer_dir` a fresh BPE tokenizer is trained on the TRAIN split only, so the
    held-out perplexity is measured on text the tokenizer never saw either.
    """
    corpus = corpus if corpus is not None else build_corpus(include=include)
    base = Path(cache_root) / f"py{platform.python_version()}-{corpus.fingerprint[:12]}"
    if tokenizer_dir is None:
        bpe_dir = base / f"bpe-v{vocab_size}"
        if not (bpe_dir / "tokenizer.json").is_file():
            tok = train_tokenizer((d.text for d in corpus.train), vocab_size=vocab_size)
            save_tokenizer(tok, bpe_dir, max_length)
        tokenizer_dir = bpe_dir
    tok = load_tokenizer(tokenizer_dir)
    thash = tokenizer_hash(tok)
    out = base / f"tok-{thash[:16]}"
    if (out / "meta.json").is_file() and (out / "tokens.npz").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tok, out, max_length)
    src_cfg = Path(tokenizer_dir) / "tokenizer_config.json"
    if src_cfg.is_file():
        shutil.copyfile(src_cfg, out / "tokenizer_config.json")
    train_ids = encode_documents(tok, corpus.train)
    heldout_ids = encode_documents(tok, corpus.heldout)
    np.savez(out / "tokens.npz", train=train_ids, heldout=heldout_ids)
    meta = {
        "python_version": platform.python_version(),
        "corpus_fingerprint": corpus.fingerprint,
        "include": list(include) if include is not None else None,
        "tokenizer_sha256": thash,
        "vocab_size": tok.get_vocab_size(),
        "train_tokens": int(train_ids.size),
        "heldout_tokens": int(heldout_ids.size),
        **corpus.stats(),
        "heldout_names": [d.name for d in corpus.heldout],
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1) + "\n")
    return out


def load_token_data(path: str | Path) -> TokenData:
    """Load a prepared-data directory; checks the ids were made with the tokenizer beside them."""
    p = Path(path)
    for f in ("tokens.npz", "meta.json", "tokenizer.json"):
        if not (p / f).is_file():
            raise ValueError(f"{p} is not a prepared-data directory (missing {f}); "
                             "make one with `labkit train --prepare-only`")
    meta = json.loads((p / "meta.json").read_text())
    if tokenizer_hash(load_tokenizer(p)) != meta["tokenizer_sha256"]:
        raise ValueError(f"{p}/tokenizer.json does not match the tokenizer the ids were made with")
    with np.load(p / "tokens.npz") as z:
        train = torch.from_numpy(z["train"].astype(np.int64))
        heldout = torch.from_numpy(z["heldout"].astype(np.int64))
    return TokenData(train=train, heldout=heldout, meta=meta, path=p)

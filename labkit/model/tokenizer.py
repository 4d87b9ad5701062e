"""A thin wrapper over a Hugging Face ``tokenizer.json`` (the ``tokenizers`` library).

Real checkpoints ship their tokenizer as tokenizer.json; reading it directly (not through
transformers) keeps labkit's core light. The BOS/EOS ids come from tokenizer_config.json or the
model's config.json, whichever names them.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(self, tokenizer: _HFTokenizer, bos_token_id: int | None = None,
                 eos_token_id: int | None = None) -> None:
        self._tok = tokenizer
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    @classmethod
    def from_dir(cls, path: str | Path, bos_token_id: int | None = None,
                 eos_token_id: int | None = None) -> Tokenizer:
        path = Path(path)
        f = path / "tokenizer.json"
        if not f.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {path}; labkit reads the fast "
                                    "tokenizer format (save it with tokenizer.save_pretrained)")
        tok = _HFTokenizer.from_file(str(f))
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())
            for attr in ("bos_token", "eos_token"):
                name = cfg.get(attr)
                if isinstance(name, dict):
                    name = name.get("content")
                tid = tok.token_to_id(name) if isinstance(name, str) else None
                if tid is not None and attr == "bos_token" and bos_token_id is None:
                    bos_token_id = tid
                if tid is not None and attr == "eos_token" and eos_token_id is None:
                    eos_token_id = tid
        return cls(tok, bos_token_id, eos_token_id)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"encode takes a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

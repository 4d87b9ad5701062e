"""A byte-level BPE tokenizer for Python code, trained with Hugging Face `tokenizers`.

Byte-level means the base alphabet is the 256 bytes, so any string round-trips exactly: no
unknown tokens, and indentation, tabs and trailing spaces decode to the very bytes that went in
(which matters for a model that writes Python). One special token, ``<|endoftext|>``, separates
documents in training and serves as both BOS and EOS; a template post-processor prepends it on
encode so labkit's `Tokenizer` and transformers' `AutoTokenizer` produce the same ids.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOT = "<|endoftext|>"
EOT_ID = 0  # first special token trained gets id 0


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096,
                    min_frequency: int = 2) -> Tokenizer:
    """Learn BPE merges over `texts` (GPT-2's pre-tokenizer regex, no prefix space)."""
    if vocab_size < 257 + 1:
        raise ValueError(f"vocab_size must exceed the 256 byte tokens + {EOT}, got {vocab_size}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    if tok.token_to_id(EOT) != EOT_ID:
        raise RuntimeError(f"{EOT} did not get id {EOT_ID}")
    tok.post_processor = processors.TemplateProcessing(
        single=f"{EOT} $A", pair=f"{EOT} $A {EOT} $B", special_tokens=[(EOT, EOT_ID)])
    return tok


def tokenizer_config(model_max_length: int) -> dict:
    """tokenizer_config.json for transformers: a generic fast tokenizer, bos = eos = EOT.

    clean_up_tokenization_spaces must be False: transformers would otherwise delete the space
    before punctuation on decode ("a , b" -> "a, b"), breaking exact round-trips of code.
    """
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "pad_token": EOT,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_prefix_space": False,
    }


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, model_max_length: int = 1024) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config(model_max_length), indent=2) + "\n")


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load tokenizer.json from a file or a directory holding one."""
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise ValueError(f"no tokenizer.json at {p}; train one with `labkit train --prepare-only`")
    return Tokenizer.from_file(str(p))


def tokenizer_hash(tok: Tokenizer) -> str:
    """sha256 of the canonical JSON: names the token ids a cached corpus was encoded with."""
    return hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest()

"""Calibration and evaluation token windows, and running a model *up to* one decoder layer.

GPTQ and AWQ both need each layer's real inputs. labkit gets them with forward hooks on the
whole model and stops the forward pass right after the layer of interest (raising an exception
from a hook), so layers already quantized feed the next one exactly as they will at inference,
without depending on any decoder layer's call signature.

Data: the training corpus's *train* split for calibration and its *held-out* split for
perplexity (labkit.train.corpus), so calibration never sees the evaluation text.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

from labkit.quant.errors import CalibrationError

MIN_CALIBRATION_TOKENS = 128


def check_calibration(tokens: torch.Tensor) -> torch.Tensor:
    """tokens must be a LongTensor [num_samples, seq_len] with enough tokens to estimate H."""
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise CalibrationError("calibration data must be a token tensor [num_samples, seq_len]")
    if tokens.numel() == 0:
        raise CalibrationError("calibration set is empty; pass at least one token window")
    if tokens.numel() < MIN_CALIBRATION_TOKENS:
        raise CalibrationError(
            f"calibration set has only {tokens.numel()} tokens; at least "
            f"{MIN_CALIBRATION_TOKENS} are needed to estimate activation statistics")
    return tokens.long()


def _windows(docs: list[str], encode: Callable[[str], list[int]], num: int, seq_len: int,
             seed: int | None) -> torch.Tensor:
    if seed is not None:
        docs = docs[:]
        random.Random(seed).shuffle(docs)
    stream: list[int] = []
    need = num * seq_len
    for text in docs:
        stream.extend(encode(text))
        if len(stream) >= need:
            break
    if len(stream) < need:
        raise CalibrationError(f"corpus split has {len(stream)} tokens, {need} requested")
    return torch.tensor(stream[:need], dtype=torch.long).view(num, seq_len)


def corpus_windows(tokenizer, split: str, num_samples: int, seq_len: int,
                   seed: int | None = 0) -> torch.Tensor:
    """``num_samples`` windows of ``seq_len`` tokens from the training corpus's split.

    split "train": documents shuffled with ``seed`` (calibration); "heldout": in corpus order
    (evaluation, identical on every run).
    """
    from labkit.train.corpus import build_corpus

    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    corpus = build_corpus()
    docs = [d.text for d in (corpus.train if split == "train" else corpus.heldout)]
    return _windows(docs, tokenizer.encode, num_samples, seq_len,
                    seed if split == "train" else None)


class _StopForward(Exception):
    pass


@contextmanager
def hooks(handles: list) -> Iterator[None]:
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def run_to_layer(model: nn.Module, tokens: torch.Tensor, stop_after: nn.Module,
                 batch_size: int = 8) -> None:
    """Run ``tokens`` through the model, cutting each forward pass after ``stop_after``."""

    def stop(*_):
        raise _StopForward

    h = stop_after.register_forward_hook(stop)
    try:
        for i in range(0, tokens.shape[0], batch_size):
            try:
                model(tokens[i:i + batch_size].to(model.device))
            except _StopForward:
                pass
    finally:
        h.remove()

"""Training text for a speculative-decoding draft: what the TARGET writes, not what the corpus says.

A draft is scored on one thing: how often its next token is the target's next token on the
text the target itself generates (greedy speculative decoding accepts a draft token exactly
when it is the target's argmax). Corpus text is a different distribution: the target's greedy
output of a code prompt repeats itself, falls into idioms and loops the corpus rarely shows.
DistillSpec (Zhou et al. 2023) closes that gap by distilling on model-generated text; here the
teacher continues short *line-start* prompts cut from the TRAIN split (the shape of the lab's
code prompts: a ``def``/``class``/statement line or two, starting a fresh sequence), greedily and
with temperature sampling (so the student also sees states just off the greedy path), all rows
of a prompt length in one batch through the reference contiguous KV cache.

Evaluation prompts stay out: a candidate prompt that contains any non-trivial line of an
evaluation prompt set (e.g. ``code_prompts``) is dropped, so measured acceptance is on prompts
the draft was not trained to continue.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

PROMPT_BUCKETS = (4, 6, 8, 12, 16, 24, 32)
_LINE_START = re.compile(r"(?m)^(?=[ \t]*\S)")


def eval_lines(prompt_sets: Iterable[str], min_chars: int = 8) -> set[str]:
    """Stripped lines (at least ``min_chars`` long) of every prompt in these prompt sets."""
    from labkit.sim.workloads import prompt_texts

    return {ln.strip() for name in prompt_sets for t in prompt_texts(name)
            for ln in t.splitlines() if len(ln.strip()) >= min_chars}


def line_prompts(texts: Sequence[str], count: int, exclude: set[str], max_lines: int = 3,
                 max_chars: int = 160, seed: int = 0) -> list[str]:
    """``count`` prompts of 1..max_lines whole lines starting at a random line start of a random
    document, each ending in a newline (like the code prompts), none containing an ``exclude``
    line. Deterministic for a seed."""
    gen = torch.Generator().manual_seed(seed)
    out: list[str] = []
    starts = [[m.start() for m in _LINE_START.finditer(t)] for t in texts]
    docs = [i for i, s in enumerate(starts) if len(s) > max_lines]
    if not docs:
        raise ValueError("no document has enough lines to cut prompts from")
    tries = 0
    while len(out) < count:
        tries += 1
        if tries > 50 * count:
            raise ValueError(f"only {len(out)} of {count} prompts found that avoid the "
                             "excluded lines; lower count or exclude less")
        d = docs[int(torch.randint(len(docs), (1,), generator=gen))]
        s = starts[d]
        i = int(torch.randint(len(s) - max_lines, (1,), generator=gen))
        n = 1 + int(torch.randint(max_lines, (1,), generator=gen))
        text = texts[d][s[i]:s[i + n]]
        text = text if text.endswith("\n") else text + "\n"
        if len(text) > max_chars or any(ln.strip() in exclude for ln in text.splitlines()):
            continue
        out.append(text)
    return out


@torch.no_grad()
def batched_generate(model: nn.Module, prompts: torch.Tensor, new_tokens: int,
                     temperature: float = 0.0,
                     generator: torch.Generator | None = None) -> torch.Tensor:
    """Continue equal-length prompts [B, P] -> [B, P + new_tokens], greedily (temperature 0)
    or by sampling softmax(logits / T); one prefill, then one batched token per step."""
    from labkit.model.generate import ContiguousKVCache

    was = model.training
    model.eval()
    B, P = prompts.shape
    cache = ContiguousKVCache(model, B, P + new_tokens)
    seq = prompts.to(model.device)
    logits = model(seq, None, cache)[:, -1]
    for i in range(new_tokens):
        if temperature == 0:
            nxt = logits.argmax(-1, keepdim=True)
        else:
            probs = torch.softmax(logits.float() / temperature, -1).cpu()
            nxt = torch.multinomial(probs, 1, generator=generator).to(seq.device)
        seq = torch.cat([seq, nxt], dim=1)
        if i + 1 < new_tokens:
            pos = torch.full((B, 1), P + i, device=seq.device)
            logits = model(nxt, pos, cache)[:, -1]
    model.train(was)
    return seq


def teacher_generations(teacher: nn.Module, prompts: Sequence[Sequence[int]], length: int,
                        temperatures: Sequence[float], batch: int = 256,
                        seed: int = 0, progress: bool = True) -> torch.Tensor:
    """[len(prompts), length]: prompt i continued by the teacher at ``temperatures[i]`` up to
    ``length`` tokens. Prompts are grouped by (token length, temperature) so each group
    generates in batches; the rows come back in the input order."""
    if len(temperatures) != len(prompts):
        raise ValueError(f"{len(temperatures)} temperatures for {len(prompts)} prompts")
    if any(not 0 < len(p) < length for p in prompts):
        raise ValueError(f"every prompt needs 1 .. {length - 1} tokens")
    groups: dict[tuple[int, float], list[int]] = defaultdict(list)
    for i, (p, t) in enumerate(zip(prompts, temperatures)):
        groups[(len(p), float(t))].append(i)
    gen = torch.Generator().manual_seed(seed)
    out = torch.empty(len(prompts), length, dtype=torch.long)
    jobs = [(key, idx[j:j + batch]) for key, idx in sorted(groups.items())
            for j in range(0, len(idx), batch)]
    for (p_len, temp), rows in tqdm(jobs, desc="teacher text", disable=not progress):
        x = torch.tensor([list(prompts[i]) for i in rows])
        out[rows] = batched_generate(teacher, x, length - p_len, temp, gen).cpu()
    return out


def draft_training_text(teacher: nn.Module, tok, texts: Sequence[str], rows: int, length: int,
                        sampled_fraction: float = 0.3, temperature: float = 0.8,
                        exclude_prompt_sets: Sequence[str] = ("code_prompts",
                                                              "spec_code_prompts"),
                        seed: int = 0, progress: bool = True) -> torch.Tensor:
    """``rows`` teacher continuations [rows, length] of line-start prompts cut from ``texts``
    (the TRAIN split), ``sampled_fraction`` of them sampled at ``temperature``, the rest greedy.
    Prompts containing a line of ``exclude_prompt_sets`` are never used."""
    prompts = line_prompts(texts, rows, eval_lines(exclude_prompt_sets), seed=seed)
    # cut each prompt to the longest bucket length it reaches: few distinct lengths means few,
    # large generation batches (one batch per length and temperature)
    buckets = [n for n in PROMPT_BUCKETS if n < length]
    ids = []
    for p in prompts:
        t = tok.encode(p)
        ids.append(t[:max([n for n in buckets if n <= len(t)], default=len(t))])
    n_sampled = int(round(sampled_fraction * rows))
    temps = [temperature if i < n_sampled else 0.0 for i in range(rows)]
    return teacher_generations(teacher, ids, length, temps, seed=seed, progress=progress)

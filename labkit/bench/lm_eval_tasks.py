"""Two small lm-evaluation-harness tasks on held-out Python, and labkit's own scoring of them.

Why: the notes tell learners to "run the business eval set after quantizing to check the accuracy
loss", and the tool people use for that is lm-evaluation-harness pointed at an OpenAI-compatible
server (``--model local-completions``). lm-eval scores a multiple-choice item by asking the server
for ``echo: true, logprobs: 1, max_tokens: 1`` on context+continuation and summing the
continuation's prompt log-probabilities; a generate_until item is a plain completion with ``stop``.
So these tasks exercise exactly the API fields issue 32 added, and the same items scored in
process (:func:`score_choices`, :func:`greedy_lines`) say whether the server's numbers are right.

The items are committed (``datasets/lm_eval/*.jsonl``; :func:`build_items` made them from the
held-out split of the lab's corpus, which differs between Python versions, hence committed):

- ``labkit_code_mc`` (multiple_choice): the 6 lines before a line of held-out code, and four
  candidate next lines, one true and three taken from other held-out files;
- ``labkit_code_line`` (generate_until): the same context plus the first half of the true
  line's text; the model completes the line (until a newline), scored by exact match.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

from labkit.paths import REPO_ROOT

TASK_DIR = REPO_ROOT / "datasets" / "lm_eval"
MC_FILE, LINE_FILE = TASK_DIR / "code_mc.jsonl", TASK_DIR / "code_line.jsonl"
CONTEXT_LINES, CHOICES = 6, 4

MC_YAML = """task: labkit_code_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: context
doc_to_choice: choices
doc_to_target: label
target_delimiter: ""
metric_list:
  - metric: acc
"""
LINE_YAML = """task: labkit_code_line
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: generate_until
doc_to_text: context
doc_to_target: target
target_delimiter: ""
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 24
  do_sample: false
  temperature: 0
metric_list:
  - metric: exact_match
"""


def _candidate_lines(text: str) -> list[int]:
    lines = text.split("\n")
    return [i for i in range(CONTEXT_LINES, len(lines))
            if 12 <= len(lines[i].strip()) <= 60 and not lines[i].strip().startswith("#")]


def build_items(n: int = 40, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """Sample ``n`` items of each task from the corpus' held-out documents (deterministic for a
    given Python install; the committed files came from Python 3.11)."""
    from labkit.train.corpus import build_corpus

    rng = random.Random(seed)
    docs = [d for d in build_corpus(with_topics=False).heldout if _candidate_lines(d.text)]
    pool = [(d, i) for d in docs for i in _candidate_lines(d.text)]
    mc, line = [], []
    for d, i in rng.sample(pool, n):
        lines = d.text.split("\n")
        context = "\n".join(lines[i - CONTEXT_LINES:i]) + "\n"
        true = lines[i]
        others = [o for o in pool if o[0].name != d.name]
        wrong = [o[0].text.split("\n")[o[1]] for o in rng.sample(others, CHOICES - 1)]
        choices = wrong + [true]
        rng.shuffle(choices)
        mc.append({"source": d.name, "context": context, "choices": choices,
                   "label": choices.index(true)})
        cut = len(true) - len(true.lstrip()) + len(true.strip()) // 2
        line.append({"source": d.name, "context": context + true[:cut], "target": true[cut:]})
    return mc, line


def write_items(mc: list[dict], line: list[dict]) -> None:
    """Write the committed JSONL files (``python -m labkit.bench.lm_eval_tasks``)."""
    TASK_DIR.mkdir(parents=True, exist_ok=True)
    for path, items in ((MC_FILE, mc), (LINE_FILE, line)):
        path.write_text("".join(json.dumps(x) + "\n" for x in items))


def load_items(path: Path) -> list[dict]:
    return [json.loads(s) for s in path.read_text().splitlines() if s.strip()]


def write_task_yaml(folder: Path, limit: int | None = None) -> Path:
    """lm-eval task configs (``--include_path folder``) for the committed items; with ``limit``
    the first ``limit`` items of each are copied next to them (a quick run)."""
    folder.mkdir(parents=True, exist_ok=True)
    for src, yaml in ((MC_FILE, MC_YAML), (LINE_FILE, LINE_YAML)):
        path = src
        if limit is not None:
            path = folder / src.name
            path.write_text("".join(src.read_text().splitlines(keepends=True)[:limit]))
        (folder / f"{src.stem}.yaml").write_text(yaml.format(path=json.dumps(str(path.resolve()))))
    return folder


def encode_pair(tok: Any, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """How lm-eval splits a loglikelihood request into tokens (``TemplateAPI._encode_pair``):
    trailing spaces of the context move to the continuation, the whole string is encoded once
    and the continuation is what follows the context's own encoding."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        continuation, context = context[-n_spaces:] + continuation, context[:-n_spaces]
    whole = tok.encode(context + continuation, add_special_tokens=False)
    ctx = tok.encode(context, add_special_tokens=False)  # lm-eval's API models add no BOS
    return ctx, whole[len(ctx):]


@torch.inference_mode()
def score_choices(model: torch.nn.Module, tok: Any, item: dict) -> list[float]:
    """Each choice's summed log-probability given the context: one plain float32 forward per
    choice with the model (no engine, no server), the in-process reference."""
    out = []
    for choice in item["choices"]:
        ctx, cont = encode_pair(tok, item["context"], choice)
        ids = torch.tensor([ctx + cont], device=model.device)
        lp = torch.log_softmax(model(ids)[0].float(), dim=-1)
        rows = torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1)
        out.append(float(lp[rows, torch.tensor(cont)].sum()))
    return out


def greedy_lines(llm: Any, tok: Any, items: list[dict], max_tokens: int = 24) -> list[str]:
    """labkit's greedy completion of each generate_until item, cut at the first newline; the
    prompt is tokenized as lm-eval's API models send it (token ids, no BOS)."""
    from labkit.engine.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0, max_tokens=max_tokens, stop=["\n"])
    ids = [tok.encode(x["context"], add_special_tokens=False) for x in items]
    return [o.outputs[0].text for o in llm.generate(prompt_token_ids=ids, sampling_params=sp)]


if __name__ == "__main__":
    write_items(*build_items())
    print(f"wrote {MC_FILE} and {LINE_FILE}")

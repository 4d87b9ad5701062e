"""``labkit distill --eagle``: train an EAGLE draft head for the teacher and ship it with a card.

The head (:mod:`labkit.spec.eagle`) is distilled from the target's own features and logits, on
the same DistillSpec text ``labkit distill`` builds for a draft model (the target's greedy and
sampled continuations of line-start prompts from the train split, evaluation prompts excluded)
mixed with corpus windows. Its folder holds the head's float16 weights, ``config.json`` (which
names the target it belongs to), ``eagle_log.json`` and README.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
from pathlib import Path

import torch


def write_eagle_card(out: Path, name: str, log: dict, n_params: int) -> None:
    cfg = log["config"]
    ev = log["eval"]
    rows = "\n".join(f"| {r['step']} | {r['step'] * cfg['batch_size'] * cfg['seq_len']:,} | "
                     f"{r.get('top1_agreement', float('nan')):.3f} |" for r in ev)
    table = "\n".join(f"| {k} | {v} |" for k, v in [
        ("", ""), ("---", "---"),
        ("own parameters", f"{n_params:,} (fc + 1 decoder layer; embedding / norm / LM head "
                           "are the target's)"),
        ("loss", f"forward KL to the target's next-token distribution + {cfg['reg_weight']:g}"
                 f" x smooth-L1 to its next feature; input-feature noise {cfg['noise']:g}"),
        ("data", f"{cfg['text_fraction']:.0%} of rows: the target's own continuations "
                 "(DistillSpec-style: greedy and temperature-sampled, of line-start prompts "
                 "cut from the TRAIN split; any prompt containing a line of the evaluation "
                 "prompt sets `code_prompts` / `spec_code_prompts` was dropped); the rest: "
                 "corpus windows"),
        ("steps", f"{log['steps']} x batch {cfg['batch_size']} x {cfg['seq_len']} tokens = "
                  f"{log['tokens_seen']:,} tokens, AdamW lr {cfg['lr']:g} (warm-up "
                  f"{cfg['warmup_steps']}, cosine to 10%), seed {cfg['seed']}"),
        ("wall time", f"{log['wall_time_s']:.0f} s on {log['device_name']} (machine shared "
                      "with other work)"),
        ("first-draft agreement with the target (α at position 1, true features) on its "
         "greedy continuations of 16 code prompts",
         f"{ev[-1].get('top1_agreement', float('nan')):.3f}"),
        ("software", f"torch {log['torch_version']}, Python {log['python_version']}")])
    text = f"""# {name}

An **EAGLE draft head** (Li et al. 2024) for `{log['teacher']}`, trained by `labkit distill
--eagle` (labkit.compress.eagle_cli, labkit.spec.eagle). It is not a standalone model: at
position p it takes the target's token t_p and the target's last hidden state f_(p-1) (the input
of its final norm) through `fc` (2d -> d) and one decoder layer of the target's shape, and
predicts f_p; the target's own final norm and LM head (shared, not stored here) turn that into
the next token. Use it with `speculative_config={{"method": "eagle", "model": "{name}"}}`.

{table}

Acceptance inside the engine (later draft positions run on the head's own predicted features,
so they agree less than position 1) is measured by `labkit bench spec` (rows `eagle`).

Command:

```
{log['command']}
```

| step | tokens | first-draft agreement α |
|---|---|---|
{rows}
"""
    (out / "README.md").write_text(text)


def run_eagle(args: argparse.Namespace, argv: list[str], teacher: torch.nn.Module, data,
              text: torch.Tensor | None, probe) -> int:
    from labkit.spec.eagle import EagleDraft, EagleTrainConfig, save_eagle, train_eagle

    torch.manual_seed(args.seed)
    head = EagleDraft(teacher)
    n_params = sum(p.numel() for p in head.parameters())
    print(f"labkit distill --eagle: head for {args.teacher}, {n_params:,} parameters",
          file=sys.stderr)
    cfg = EagleTrainConfig(steps=args.max_steps, batch_size=args.batch_size,
                           seq_len=args.seq_len, lr=args.lr, warmup_steps=args.warmup_steps,
                           text_fraction=args.teacher_text_fraction if text is not None else 0,
                           time_budget_s=args.time_budget, eval_every=args.eval_every,
                           seed=args.seed)
    log = train_eagle(teacher, head, cfg, data.train, text, [x for x, _ in probe],
                      on_eval=lambda r: print(json.dumps(r), file=sys.stderr, flush=True))
    log.update(teacher=args.teacher, command="labkit distill " + shlex.join(argv),
               spec_data_rows=args.spec_data, torch_version=torch.__version__,
               python_version=platform.python_version(),
               device_name=f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)")
    save_eagle(head, args.out, args.teacher)
    (args.out / "eagle_log.json").write_text(json.dumps(log, indent=1) + "\n")
    write_eagle_card(args.out, args.name or args.out.name, log, n_params)
    print(json.dumps({"out": str(args.out), "steps": log["steps"],
                      "top1_agreement": log["eval"][-1].get("top1_agreement")}))
    return 0

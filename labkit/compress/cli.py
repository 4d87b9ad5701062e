"""``labkit distill``: distill a student from a teacher on the lab's corpus, save it HF-style.

    labkit distill --teacher labkit-tiny --student labkit-tiny-draft-indep \\
        --out /tmp/draft --max-steps 400 --time-budget 1500

The student starts from a checkpoint (``--student``), from a subset of the teacher's layers
(``--drop-layers 0,5``), or from scratch with a ``labkit train`` preset (``--student-preset``).
The output folder holds the model in Hugging Face layout, ``distill_log.json`` (+ the fields
``labkit train``'s cards have), a card (README.md) and, with ``--chart``, the loss/agreement
curve. The probe is the teacher's greedy continuation of the lab's code prompts: top-1 agreement
there is the draft's per-token greedy acceptance probability α.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from labkit.compress.distill import Probe
    from labkit.train.trainer import TrainConfig


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="labkit distill", description=__doc__.split("\n")[0])
    p.add_argument("--teacher", default="labkit-tiny")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--student", help="checkpoint to start from (name or folder)")
    g.add_argument("--drop-layers", help="start from these teacher layers, e.g. 0,5")
    g.add_argument("--student-preset", help="fresh student with a `labkit train` preset")
    g.add_argument("--eagle", action="store_true",
                   help="train an EAGLE draft head on the teacher's features instead of a "
                        "student model (labkit.spec.eagle)")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--data", type=Path, default=None,
                   help="prepared-data directory (`labkit train --prepare-only`); default: "
                        "built from this Python's stdlib with the teacher's tokenizer")
    p.add_argument("--name", default=None, help="model name on the card (default: out's name)")
    p.add_argument("--max-steps", type=int, default=200)
    p.add_argument("--time-budget", type=float, default=None, help="stop after SECONDS")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--warmup-steps", type=int, default=20)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--direction", choices=("forward", "reverse"), default="forward")
    p.add_argument("--hard-weight", type=float, default=0.0)
    p.add_argument("--hard-label", choices=("data", "teacher"), default="data",
                   help="hard-label target: the text's next token or the teacher's argmax")
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-max-tokens", type=int, default=16384)
    p.add_argument("--probe-prompts", default="code_prompts")
    p.add_argument("--probe-tokens", type=int, default=64)
    p.add_argument("--probe-count", type=int, default=16)
    p.add_argument("--teacher-text-rows", type=int, default=0,
                   help="teacher greedy continuations of train-split prompts to mix in")
    p.add_argument("--teacher-text-fraction", type=float, default=0.5,
                   help="share of each batch's rows taken from the teacher text")
    p.add_argument("--spec-data", type=int, default=0, metavar="ROWS",
                   help="DistillSpec data: ROWS teacher continuations of line-start prompts "
                        "from the train split (evaluation prompts excluded); replaces "
                        "--teacher-text-rows")
    p.add_argument("--spec-data-sampled", type=float, default=0.3,
                   help="share of --spec-data rows sampled (the rest greedy)")
    p.add_argument("--spec-data-temperature", type=float, default=0.8)
    p.add_argument("--text-cache", type=Path, default=None,
                   help="load the teacher text from this .pt file if it exists, else save it")
    p.add_argument("--threads", type=int, default=None, help="torch threads")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chart", metavar="HTML", help="write the loss / agreement curve")
    return p


def make_student(args: argparse.Namespace, teacher: torch.nn.Module) -> tuple[torch.nn.Module,
                                                                              str]:
    from labkit.compress.distill import drop_layers
    from labkit.model.llama import LlamaForCausalLM
    from labkit.model.loader import load_pretrained
    from labkit.train.presets import get_preset
    from labkit.train.trainer import init_weights

    if args.drop_layers:
        keep = [int(i) for i in args.drop_layers.split(",")]
        return drop_layers(teacher, keep), f"teacher layers {keep}"
    if args.student_preset:
        torch.manual_seed(args.seed)
        m = LlamaForCausalLM(get_preset(args.student_preset,
                                        teacher.config.vocab_size).model)
        init_weights(m)
        return m, f"fresh {args.student_preset} (random init)"
    name = args.student or "labkit-tiny-draft"
    return load_pretrained(name)[0], f"the weights of `{name}`"


def make_text(args: argparse.Namespace, teacher: torch.nn.Module, tok, data):
    """The teacher text mixed into batches (None without --spec-data / --teacher-text-rows),
    from or into ``--text-cache``."""
    from labkit.compress.distill import teacher_text
    from labkit.compress.spec_data import draft_training_text
    from labkit.train.corpus import build_corpus

    if not (args.spec_data or args.teacher_text_rows):
        return None
    if args.text_cache and args.text_cache.is_file():
        return torch.load(args.text_cache)
    if args.spec_data:
        texts = [d.text for d in build_corpus().train]
        text = draft_training_text(teacher, tok, texts, args.spec_data, args.seq_len + 1,
                                   args.spec_data_sampled, args.spec_data_temperature,
                                   seed=args.seed + 1)
    else:
        text = teacher_text(teacher, data.train, args.teacher_text_rows, args.seq_len + 1,
                            seed=args.seed + 1)
    if args.text_cache:
        torch.save(text, args.text_cache)
    return text


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    from labkit.compress.card import write_distill_card
    from labkit.compress.distill import DistillConfig, distill
    from labkit.model.loader import load_pretrained, resolve_model_path
    from labkit.train.data import load_token_data, prepare_data
    from labkit.train.export import export_hf

    if args.threads:
        torch.set_num_threads(args.threads)
    teacher, tok = load_pretrained(args.teacher)
    tdir = resolve_model_path(args.teacher)
    data = load_token_data(args.data or prepare_data(tokenizer_dir=tdir))
    probe = _make_probe(args, teacher, tok)
    cfg = _train_config(args)
    kd = DistillConfig(args.temperature, args.direction, args.hard_weight, args.hard_label)
    text = make_text(args, teacher, tok, data)
    if args.eagle:
        from labkit.compress.eagle_cli import run_eagle

        return run_eagle(args, argv, teacher, data, text, probe)
    student, init = make_student(args, teacher)
    print(f"labkit distill: {args.teacher} -> student from {init}, "
          f"{sum(p.numel() for p in student.parameters()):,} parameters", file=sys.stderr)
    fraction = args.teacher_text_fraction if text is not None else 0.0
    student, log = distill(student, teacher, cfg, kd, data.train, data.heldout, probe,
                           on_eval=lambda r: print(json.dumps(r), file=sys.stderr, flush=True),
                           text=text, text_fraction=fraction)
    _add_provenance(log, args, argv, init, fraction)
    export_hf(student, student.config, tdir, args.out)
    write_distill_card(args.out, args.name or args.out.name, student, teacher, log, data,
                       probe)
    if args.chart:
        from labkit.compress.card import distill_chart

        distill_chart(log).write_html(args.chart, include_plotlyjs="cdn")
    last = log["eval"][-1]
    print(json.dumps({"out": str(args.out), "steps": log["steps"],
                      "heldout_perplexity": round(math.exp(last["heldout_loss"]), 3),
                      "top1_agreement": last.get("top1_agreement")}))
    return 0


def _make_probe(args: argparse.Namespace, teacher: torch.nn.Module, tok) -> Probe:
    """The teacher's greedy continuations of the first ``--probe-count`` prompts of
    ``--probe-prompts``: top-1 agreement on them is the draft's greedy acceptance α."""
    from labkit.compress.distill import greedy_continuations
    from labkit.sim.workloads import prompt_texts

    prompts = [tok.encode(t) for t in prompt_texts(args.probe_prompts)[:args.probe_count]]
    return greedy_continuations(teacher, prompts, args.probe_tokens)


def _train_config(args: argparse.Namespace) -> TrainConfig:
    """labkit.train's schedule and batches, with the flags' sizes (no weight decay: the
    student is pulled towards the teacher, not towards zero)."""
    from labkit.train.trainer import TrainConfig

    return TrainConfig(seq_len=args.seq_len, batch_size=args.batch_size,
                       max_steps=args.max_steps, time_budget_s=args.time_budget, lr=args.lr,
                       warmup_steps=args.warmup_steps, eval_every=args.eval_every,
                       eval_max_tokens=args.eval_max_tokens, log_every=5, seed=args.seed,
                       weight_decay=0.0)


def _add_provenance(log: dict, args: argparse.Namespace, argv: list[str], init: str,
                    fraction: float) -> None:
    """What the card needs beyond the training log: the data mix, the start, the command and
    the software it ran on."""
    log.update(teacher_text_rows=args.teacher_text_rows, spec_data_rows=args.spec_data,
               spec_data_sampled=args.spec_data_sampled,
               spec_data_temperature=args.spec_data_temperature,
               teacher_text_fraction=fraction,
               student_init=init,
               teacher=args.teacher, command="labkit distill " + shlex.join(argv),
               torch_version=torch.__version__,
               python_version=platform.python_version(),
               device_name=f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)")


if __name__ == "__main__":
    raise SystemExit(main())

"""`labkit finetune --lora`: train a LoRA (or, with ``--qlora``, a QLoRA) adapter on a style
slice of the stdlib and write it as a PEFT folder with a card.

    labkit finetune --lora --style tests --out /tmp/lora-tests          # minutes on a CPU
    labkit finetune --lora --qlora --style docstring --steps 100 --out /tmp/qlora-doc

The folder holds ``adapter_config.json`` + ``adapter_model.safetensors`` (``peft`` loads it with
``PeftModel.from_pretrained``; labkit serves it with ``LoRARequest``), ``finetune_log.json``
(the run's settings, curve and held-out losses; ``labkit lora merge`` reads ``qlora`` from it)
and ``README.md``, the card.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
from pathlib import Path

import torch

from labkit.train.lora_data import STYLES, StyleSlice, build_slice, slice_token_ids
from labkit.train.lora_finetune import DEFAULT_TARGETS, LoRATrainConfig

SAMPLE_PROMPTS = ("def ", "def test_")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="labkit finetune", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lora", action="store_true", required=True,
                   help="train a LoRA adapter (the only mode; full training is `labkit train`)")
    p.add_argument("--qlora", action="store_true",
                   help="train on the NF4-quantized base (QLoRA)")
    p.add_argument("--base", default="labkit-tiny", help="shipped model name or HF folder")
    p.add_argument("--style", choices=STYLES, default="docstring",
                   help="which slice of the stdlib (labkit.train.lora_data)")
    p.add_argument("--r", type=int, default=8, help="adapter rank")
    p.add_argument("--alpha", type=float, default=16.0, help="lora_alpha (scaling alpha / r)")
    p.add_argument("--target-modules", nargs="+", default=list(DEFAULT_TARGETS))
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--max-chars", type=int, default=400_000,
                   help="training text of the slice, in characters")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (1 is fastest on a machine shared with other work)")
    p.add_argument("--eval-max-tokens", type=int, default=8192,
                   help="held-out tokens per evaluation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, required=True, help="adapter folder to write")
    return p


def _losses(model: torch.nn.Module, layers: dict, heldout: dict[str, torch.Tensor],
            cfg: LoRATrainConfig) -> dict[str, dict[str, float]]:
    """Held-out loss per slice with the adapter off (scaling 0: exactly the base) and on."""
    from labkit.train.trainer import evaluate

    out = {}
    for style, ids in heldout.items():
        row = {}
        for name, s in (("base", 0.0), ("adapter", cfg.scaling)):
            for m in layers.values():
                m.scaling = s
            row[name] = evaluate(model, ids, cfg.seq_len, cfg.batch_size, cfg.eval_max_tokens)
        out[style] = row
    return out


def _samples(model: torch.nn.Module, layers: dict, tok, cfg: LoRATrainConfig,
             n: int = 40) -> list[dict[str, str]]:
    """Greedy continuations of a few prompts, base vs adapter: the style made visible."""
    from labkit.model.generate import generate

    rows = []
    for prompt in SAMPLE_PROMPTS:
        ids = tok.encode(prompt).ids
        row = {"prompt": prompt}
        for name, s in (("base", 0.0), ("adapter", cfg.scaling)):
            for m in layers.values():
                m.scaling = s
            with torch.no_grad():
                row[name] = prompt + tok.decode(generate(model, ids, n, ignore_eos=True))
        rows.append(row)
    for m in layers.values():
        m.scaling = cfg.scaling
    return rows


def run(args: argparse.Namespace, argv: list[str]) -> dict:
    """The whole command; returns the summary it prints."""
    from labkit.lora.writer import save_peft_adapter
    from labkit.model.loader import load_model, resolve_model_path
    from labkit.train.lora_finetune import adapter_weights, finetune_lora, prepare_base
    from labkit.train.tokenizer import load_tokenizer

    base_path = resolve_model_path(args.base)
    tok = load_tokenizer(base_path)
    slices = {s: build_slice(s, max_chars=args.max_chars) for s in STYLES}
    ids = {s: slice_token_ids(tok, sl) for s, sl in slices.items()}
    cfg = LoRATrainConfig(r=args.r, alpha=args.alpha, target_modules=tuple(args.target_modules),
                          steps=args.steps, lr=args.lr, batch_size=args.batch_size,
                          seq_len=args.seq_len, eval_max_tokens=args.eval_max_tokens,
                          seed=args.seed, qlora=args.qlora,
                          eval_every=max(1, args.steps // 3))
    model = prepare_base(load_model(base_path, dtype=torch.float32, device="cpu"), cfg)
    train_ids, heldout_ids = ids[args.style]
    layers, log = finetune_lora(model, cfg, train_ids, heldout_ids)
    log["heldout_losses"] = _losses(model, layers, {s: h for s, (_, h) in ids.items()}, cfg)
    log["samples"] = _samples(model, layers, tok, cfg)
    log.update(style=args.style, base=str(args.base), slice=slices[args.style].stats(),
               heldout_files=slices[args.style].heldout_files,
               command="labkit finetune " + shlex.join(argv),
               software={"torch": torch.__version__, "python": platform.python_version()})
    save_peft_adapter(args.out, adapter_weights(layers), cfg.r, cfg.alpha,
                      base_model=str(args.base))
    (args.out / "finetune_log.json").write_text(json.dumps(log, indent=1) + "\n")
    write_card(args.out, log, slices)
    own = log["heldout_losses"][args.style]
    return {"out": str(args.out), "style": args.style, "qlora": cfg.qlora,
            "heldout_loss_base": own["base"], "heldout_loss_adapter": own["adapter"]}


def write_card(out: Path, log: dict, slices: dict[str, StyleSlice]) -> None:
    """README.md: what the adapter is, how it was made, and what it does to held-out loss."""
    cfg, style = log["config"], log["style"]
    base = "the NF4-quantized" if cfg["qlora"] else "the full-precision"
    lines = [f"# {out.name}", "",
             f"A LoRA adapter on `{log['base']}` that pulls its output toward the **{style}** "
             f"style of Python, trained by `labkit finetune --lora` on {base} base "
             f"({'QLoRA' if cfg['qlora'] else 'LoRA'}; the base stays frozen).", "",
             "| | |", "|---|---|",
             f"| rank / alpha | {cfg['r']} / {cfg['alpha']:g} (scaling "
             f"{cfg['alpha'] / cfg['r']:g}) |",
             f"| target modules | {', '.join(cfg['target_modules'])} |",
             f"| trainable parameters | {log['trainable_parameters']:,} |",
             f"| steps | {cfg['steps']} x batch {cfg['batch_size']} x {cfg['seq_len']} tokens, "
             f"AdamW lr {cfg['lr']:g}, warm-up {cfg['warmup_steps']}, cosine to "
             f"{cfg['min_lr_ratio']:g} x lr, clip {cfg['grad_clip']:g}, seed {cfg['seed']} |",
             f"| data | {_data_line(slices[style])} |",
             f"| wall time | {log['wall_time_s']:.0f} s on CPU |",
             f"| software | torch {log['software']['torch']}, Python "
             f"{log['software']['python']} |", "",
             "Command:", "", "```", log["command"], "```", "",
             "## Held-out loss (mean per token; lower is better)", "",
             "Each slice's held-out functions come from files neither the base model nor the "
             "adapter trained on (the corpus's own held-out split).", "",
             "| slice | base | with adapter | change |", "|---|---|---|---|"]
    for s, row in log["heldout_losses"].items():
        mark = " (own)" if s == style else ""
        lines.append(f"| {s}{mark} | {row['base']:.4f} | {row['adapter']:.4f} | "
                     f"{row['adapter'] - row['base']:+.4f} |")
    lines += ["", "## Training curve", "", "| step | train loss | held-out loss |",
              "|---|---|---|"]
    evals = {e["step"]: e["heldout_loss"] for e in log["eval"]}
    lines.append(f"| 0 (the base) | | {evals[0]:.4f} |")
    for e in log["train"]:
        h = evals.get(e["step"])
        lines.append(f"| {e['step']} | {e['loss']:.4f} | {'' if h is None else f'{h:.4f}'} |")
    lines += ["", "## Greedy samples, base vs adapter", ""]
    for row in log["samples"]:
        lines += ["Base:", "", "```python", row["base"], "```", "", "With the adapter:", "",
                  "```python", row["adapter"], "```", ""]
    (out / "README.md").write_text("\n".join(lines))


def _data_line(s: StyleSlice) -> str:
    st = s.stats()
    rule = {"docstring": "functions with a docstring, outside the test suites",
            "tests": "`test*` methods of the stdlib's unittest suites"}[s.style]
    return (f"{rule} (labkit.train.lora_data): {st['train_functions']} functions from "
            f"{st['train_files']} files ({st['train_chars']:,} chars); held out "
            f"{st['heldout_functions']} functions from {st['heldout_files']} files")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps(run(args, argv)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`labkit train`: corpus -> tokenizer -> token ids -> model -> Hugging Face folder + card.

    labkit train --smoke                          # minutes on a CPU: the whole path, small
    labkit train --preset labkit-tiny             # the shipped target (use a GPU)
    labkit train --preset labkit-tiny-draft       # the shipped draft, same tokenizer
    labkit train --prepare-only                   # build corpus + tokenizer + ids, print the dir
    labkit train --preset labkit-tiny --data DIR  # train on a prepared dir (e.g. copied to a GPU)

Interrupted? Run the same command with ``--resume``: it continues from the last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from labkit.train.data import DEFAULT_CACHE, TokenData, load_token_data, prepare_data
from labkit.train.presets import PRESETS, Preset, get_preset
from labkit.train.tokenizer import load_tokenizer

if TYPE_CHECKING:
    from labkit.model.llama import LlamaForCausalLM
    from labkit.train.trainer import TrainConfig

SHIPPED_DIR = Path("datasets") / "models"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="labkit train", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), default="labkit-tiny",
                   help="model shape and training settings (default: labkit-tiny)")
    p.add_argument("--smoke", action="store_true", help="same as --preset smoke")
    p.add_argument("--out", type=Path, help="output model folder (default: datasets/models/"
                   "<preset>, or .cache/labkit-train/runs/smoke/model for the smoke run)")
    p.add_argument("--data", type=Path, help="prepared-data dir (default: build and cache one)")
    p.add_argument("--tokenizer", type=Path, help="reuse this tokenizer instead of training one")
    p.add_argument("--vocab-size", type=int, help="BPE vocabulary when training a tokenizer")
    p.add_argument("--prepare-only", action="store_true",
                   help="only build the corpus, tokenizer and token ids; print the dir")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--max-steps", type=int, help="optimizer steps (default: max-epochs worth)")
    p.add_argument("--time-budget", type=float, help="seconds to train; fixes --max-steps "
                   "after timing a few steps (capped by --max-epochs)")
    p.add_argument("--max-epochs", type=float, help="passes over the train tokens")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--lr", type=float)
    p.add_argument("--warmup-steps", type=int)
    p.add_argument("--eval-every", type=int)
    p.add_argument("--eval-max-tokens", type=int, help="cap held-out tokens per evaluation")
    p.add_argument("--checkpoint-every", type=int, default=500)
    p.add_argument("--checkpoint", type=Path, help="training checkpoint file (default: "
                   ".cache/labkit-train/runs/<preset>/checkpoint.pt)")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--stop-after", type=int, help="stop after this step (resume later)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cpu | cuda (default: cuda if available)")
    p.add_argument("--compare-with", type=Path, nargs="+", default=[],
                   help="model folders whose held-out loss the card lists beside this model's, "
                   "measured the same way (e.g. a dense twin with the same active parameters)")
    p.add_argument("--sample-tokens", type=int, default=48,
                   help="new tokens per sample completion on the card")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.smoke:
        args.preset = "smoke"
    preset = get_preset(args.preset)
    device = _checked_device(parser, args)

    if args.data is None:
        include = list(preset.include) if preset.include else None
        args.data = prepare_data(include=include, vocab_size=args.vocab_size or preset.vocab_size,
                                 tokenizer_dir=args.tokenizer, cache_root=args.cache_dir,
                                 max_length=preset.model.max_position_embeddings)
    if args.prepare_only:
        print(args.data)
        return 0
    data = load_token_data(args.data)
    vocab = load_tokenizer(args.data).get_vocab_size()
    preset = get_preset(args.preset, vocab_size=vocab)

    from labkit.train.trainer import train

    cfg = _train_config(args, preset, data.train.numel(), device)
    if device == "cpu" and preset.name != "smoke" and args.max_steps is None:
        print(f"note: {preset.name} takes hours on a CPU (it was trained on a GPU); try "
              "--smoke, or --max-steps N for a shorter run", file=sys.stderr)
    ckpt = args.checkpoint or args.cache_dir / "runs" / preset.name / "checkpoint.pt"
    out = args.out or (args.cache_dir / "runs" / "smoke" / "model" if preset.name == "smoke"
                       else SHIPPED_DIR / preset.name)
    print(f"labkit train: {preset.name}, {preset.model.num_parameters():,} parameters, "
          f"{data.train.numel():,} train / {data.heldout.numel():,} held-out tokens, {device}",
          file=sys.stderr)
    model, log = train(preset.model, cfg, data.train, data.heldout, ckpt, resume=args.resume)
    log["device_name"] = (torch.cuda.get_device_name(device) if device.startswith("cuda")
                          else f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)")
    log["torch_version"] = torch.__version__
    log["python_version"] = platform.python_version()
    if not log["finished"]:
        print(f"stopped after step {log['steps']}; checkpoint at {ckpt} (rerun with --resume)",
              file=sys.stderr)
        return 0
    if preset.model.moe_layers:
        log["active_parameters"] = preset.model.num_parameters(active=True)
    _ship(model, preset, args, data, log, out, cfg.seq_len, "labkit train " + shlex.join(argv))
    return 0


def _checked_device(parser: argparse.ArgumentParser, args: argparse.Namespace) -> str:
    """Refuse nonsense sizes and a CUDA device torch cannot see before any data is built."""
    for name in ("max_steps", "batch_size", "seq_len", "warmup_steps", "eval_every",
                 "vocab_size", "eval_max_tokens"):
        v = getattr(args, name)
        if v is not None and v < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {v}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda asked for, but torch sees no CUDA device")
    return device


def _train_config(args: argparse.Namespace, preset: Preset, train_tokens: int,
                  device: str) -> TrainConfig:
    """The preset's settings with the flags' overrides; with neither --max-steps nor
    --time-budget, max_steps is max_epochs worth of batches (400 for the smoke preset)."""
    from labkit.train.trainer import TrainConfig

    max_steps = args.max_steps
    max_epochs = args.max_epochs if args.max_epochs is not None else preset.max_epochs
    batch = args.batch_size or preset.batch_size
    seq_len = args.seq_len or preset.seq_len
    if max_steps is None and args.time_budget is None:
        if max_epochs is None:
            max_steps = 400  # the smoke preset: a few minutes on a laptop CPU
        else:
            max_steps = max(1, int(max_epochs * train_tokens / (batch * seq_len)))
    return TrainConfig(
        seq_len=seq_len, batch_size=batch, max_steps=max_steps, time_budget_s=args.time_budget,
        max_epochs=max_epochs, lr=args.lr or preset.lr,
        warmup_steps=args.warmup_steps or preset.warmup_steps,
        eval_every=args.eval_every or preset.eval_every, eval_max_tokens=args.eval_max_tokens,
        checkpoint_every=args.checkpoint_every, stop_after=args.stop_after, seed=args.seed,
        device=device, aux_loss_coef=preset.aux_loss_coef, z_loss_coef=preset.z_loss_coef)


def _ship(model: LlamaForCausalLM, preset: Preset, args: argparse.Namespace, data: TokenData,
          log: dict, out: Path, seq_len: int, command: str) -> None:
    """Export the finished model, measure it as a user loads it, write its card, print a
    one-line JSON summary."""
    from labkit.train.card import compare_models, shipped_metrics, write_card
    from labkit.train.export import export_hf

    export_hf(model, preset.model, args.data, out)
    shipped = shipped_metrics(out, data.heldout, seq_len, args.eval_max_tokens,
                              args.sample_tokens)
    if args.compare_with:
        shipped["compare"] = compare_models(args.compare_with, data.heldout, seq_len,
                                            args.eval_max_tokens)
    write_card(out, preset.name, log, data.meta, command, shipped)
    summary = {"out": str(out), "steps": log["steps"], "tokens_seen": log["tokens_seen"],
               "wall_time_s": round(log["wall_time_s"], 1),
               "heldout_loss": log["eval"][-1]["heldout_loss"],
               "heldout_loss_fp16_weights": shipped["heldout_loss_fp16_weights"]}
    print(json.dumps(summary))


if __name__ == "__main__":
    raise SystemExit(main())

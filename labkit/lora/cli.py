"""`labkit lora merge`: fold an adapter into its base and write a model folder.

    labkit lora merge --base labkit-tiny --adapter ADAPTER --out merged/          # float32 HF
    labkit lora merge --base labkit-tiny --adapter QLORA --out merged-gptq/ --quantize gptq

Without ``--quantize`` the folder is a Hugging Face checkpoint (``labkit.LLM(model=folder)``,
``transformers``). With ``--quantize gptq`` it is a GPTQ checkpoint in AutoGPTQ's layout
(``labkit serve folder --quantization gptq``, ``labkit.quant.checkpoint.load_quantized``).
An adapter trained with ``labkit finetune --lora --qlora`` (its ``finetune_log.json`` says so)
is merged into the *de-quantized NF4* base it was trained against, not the original weights:
that is the function it learned to correct (:mod:`labkit.lora.merge`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch


def trained_on_nf4(adapter: Path) -> tuple[bool, int]:
    """(qlora, NF4 block size) from the adapter's ``finetune_log.json``; (False, 64) without."""
    f = Path(adapter) / "finetune_log.json"
    if not f.is_file():
        return False, 64
    cfg = json.loads(f.read_text()).get("config", {})
    return bool(cfg.get("qlora")), int(cfg.get("nf4_blocksize", 64))


def merged_model(base: str | Path, adapter: str | Path, nf4_base: bool | None = None,
                 blocksize: int | None = None) -> torch.nn.Module:
    """The float32 merged model: ``W + s B A``, with ``W = deq(nf4(W))`` for a QLoRA adapter."""
    from labkit.lora.merge import dequantize_model, merge_lora
    from labkit.model.loader import load_model

    qlora, bs = trained_on_nf4(Path(adapter))
    nf4_base = qlora if nf4_base is None else nf4_base
    model = load_model(base, dtype=torch.float32, device="cpu")
    if nf4_base:
        from labkit.quant.model import quantize_model

        model = dequantize_model(quantize_model(model, "nf4", blocksize=blocksize or bs),
                                 inplace=True)
    return merge_lora(model, str(adapter), "fp", inplace=True)


def gptq(model: torch.nn.Module, calibration: torch.Tensor, bits: int = 4,
         group_size: int = 64, sym: bool = False) -> torch.nn.Module:
    """GPTQ every decoder linear of ``model`` on ``calibration`` windows (group sizes that do
    not divide a layer fall back to the largest that does). ``sym``: symmetric groups, for a
    merged weight whose groups are all one sign (the GPTQ v1 layout cannot store a zero point
    of 0, and saving says so)."""
    from labkit.quant.model import gptq_quantize_model

    q, _ = gptq_quantize_model(model, calibration, bits=bits, group_size=group_size, sym=sym,
                               group_fallback=True, inplace=True, progress=False)
    return q


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="labkit lora", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("merge", help="merge an adapter into its base (optionally GPTQ it)")
    m.add_argument("--base", required=True, help="shipped model name or HF folder")
    m.add_argument("--adapter", required=True, type=Path, help="PEFT adapter folder")
    m.add_argument("--out", required=True, type=Path)
    m.add_argument("--quantize", choices=("none", "gptq"), default="none")
    m.add_argument("--nf4-base", choices=("auto", "yes", "no"), default="auto",
                   help="merge into the de-quantized NF4 base (auto: if the adapter's "
                   "finetune_log.json says it was trained with --qlora)")
    m.add_argument("--bits", type=int, default=4)
    m.add_argument("--group-size", type=int, default=64,
                   help="GPTQ group size (64: one scale per 64 weights, as NF4's blocks)")
    m.add_argument("--sym", action="store_true", help="symmetric GPTQ groups")
    m.add_argument("--calib-samples", type=int, default=32, help="GPTQ calibration windows")
    m.add_argument("--calib-seq-len", type=int, default=256)
    m.add_argument("--dtype", choices=("float32", "float16"), default="float32",
                   help="weights of an unquantized merged folder")
    return p


def merge_command(args: argparse.Namespace) -> Path:
    from labkit.model.loader import has_tokenizer, resolve_model_path

    base = resolve_model_path(args.base)
    nf4 = {"auto": None, "yes": True, "no": False}[args.nf4_base]
    model = merged_model(base, args.adapter, nf4)
    tok_dir = base if has_tokenizer(base) else None
    if args.quantize == "gptq":
        from labkit.model.loader import load_pretrained
        from labkit.quant.calib import corpus_windows
        from labkit.quant.checkpoint import save_quantized

        if tok_dir is None:
            raise SystemExit(f"{base} has no tokenizer: GPTQ needs calibration text")
        _, tok = load_pretrained(base)
        calib = corpus_windows(tok, "train", args.calib_samples, args.calib_seq_len, seed=0)
        return save_quantized(gptq(model, calib, args.bits, args.group_size, args.sym), args.out,
                              tokenizer_dir=tok_dir)
    from labkit.train.export import export_hf, save_weights

    dtype = getattr(torch, args.dtype)
    if tok_dir is None:
        return save_weights(model, model.config, args.out, dtype)
    return export_hf(model, model.config, tok_dir, args.out, dtype)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    out = merge_command(args)
    kind = f"GPTQ {args.bits}-bit" if args.quantize == "gptq" else args.dtype
    print(f"wrote {out} ({kind})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

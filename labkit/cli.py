"""The ``labkit`` command: info, generate, train, finetune, lora, bench, drill, serve, router,
cluster.

Subcommands that need heavy modules import them only when run, so ``labkit --help`` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys
from collections.abc import Sequence


def _cmd_info(args: argparse.Namespace) -> int:
    import platform

    import torch

    from labkit import __version__
    from labkit.model.loader import available_models, models_dir

    print(f"labkit      {__version__}")
    print(f"python      {platform.python_version()} ({platform.machine()})")
    print(f"torch       {torch.__version__}")
    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = "not installed"
    print(f"triton      {tv}")
    interp = os.environ.get("TRITON_INTERPRET") == "1"
    state = "1: kernels run on CPU through the interpreter" if interp else "unset"
    print(f"interpreter TRITON_INTERPRET={state}")
    if torch.cuda.is_available():
        print(f"device      cuda: {torch.cuda.get_device_name(0)}")
    else:
        print(f"device      cpu ({torch.get_num_threads()} threads); no CUDA device")
    for pkg in ("transformers", "bitsandbytes", "plotly", "ipywidgets"):
        try:  # the installed metadata: importing bitsandbytes just for this prints warnings
            print(f"{pkg:<11} {importlib.metadata.version(pkg)}")
        except importlib.metadata.PackageNotFoundError:
            print(f"{pkg:<11} not installed")
    models = available_models()
    print(f"models      {', '.join(models) if models else '(none shipped)'}  [{models_dir()}]")
    return 0


def _check_generate_args(args: argparse.Namespace) -> None:
    """Refuse bad sampling settings and an empty prompt as usage errors, before any loading."""
    from labkit.model.sampling import validate_sampling

    try:
        validate_sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as e:
        args.parser.error(str(e))
    if args.max_tokens < 1:
        args.parser.error(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if not args.prompt:
        args.parser.error("PROMPT is empty: give some text to continue")


def _cmd_generate(args: argparse.Namespace) -> int:
    from labkit.model.loader import CheckpointError, load_pretrained

    _check_generate_args(args)
    from labkit.parallel.launch import exit_rank, torchrun_env, worker_loop

    launched = torchrun_env()  # torchrun started us: rank 0 drives, the others serve it
    if launched is not None:
        rank, world, _ = launched
        if args.tp not in (1, world):
            args.parser.error(f"--tp {args.tp} under torchrun must equal its WORLD_SIZE {world}")
        if rank:
            exit_rank(worker_loop(args.device or "cpu"))
        args.tp = world
        exit_rank(_generate_tp(args, "external_launcher"))
    if args.tp != 1:
        return _generate_tp(args)
    try:
        model, tok = load_pretrained(args.model, dtype=args.dtype, device=args.device)
    except CheckpointError as e:
        args.parser.error(str(e))
    from labkit.model.generate import stream_generate

    ids = tok.encode(args.prompt)
    if len(ids) >= model.config.max_position_embeddings:
        args.parser.error(f"prompt is {len(ids)} tokens; the model's context is "
                          f"{model.config.max_position_embeddings}")
    # Decode the whole output each step and print only the new characters, so characters
    # spanning several tokens and merged whitespace come out right.
    sys.stdout.write(args.prompt)
    sys.stdout.flush()
    out: list[int] = []
    printed = ""
    for t in stream_generate(model, ids, args.max_tokens, args.temperature, args.top_k,
                             args.top_p, seed=args.seed):
        if t in model.config.eos_token_ids:
            break
        out.append(t)
        text = tok.decode(out)
        sys.stdout.write(text[len(printed):])
        sys.stdout.flush()
        printed = text
    sys.stdout.write("\n")
    return 0


def _generate_tp(args: argparse.Namespace, backend: str | None = None) -> int:
    """Stream through the engine with ``tensor_parallel_size=args.tp`` worker processes
    (spawned here, or started by torchrun: ``backend="external_launcher"``)."""
    from labkit.engine.llm import LLM
    from labkit.engine.sampling_params import SamplingParams
    from labkit.model.loader import CheckpointError

    try:
        llm = LLM(args.model, tensor_parallel_size=args.tp, dtype=args.dtype, device=args.device,
                  enable_expert_parallel=args.enable_expert_parallel,
                  distributed_executor_backend=backend)
    except (CheckpointError, ValueError) as e:
        args.parser.error(str(e))
    try:
        eng = llm.llm_engine
        eng.add_request("cli", args.prompt, SamplingParams(
            temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
            seed=args.seed, max_tokens=args.max_tokens))
        sys.stdout.write(args.prompt)
        while eng.has_unfinished_requests():
            for o in eng.step():
                sys.stdout.write(o.text_delta)
                sys.stdout.flush()
        sys.stdout.write("\n")
    finally:
        llm.shutdown()
    return 0


def _delegate(module: str, argv: Sequence[str]) -> int:
    return int(importlib.import_module(module).main(list(argv)) or 0)


def _cmd_bench(args: argparse.Namespace) -> int:
    from labkit.bench import BENCHMARKS

    if args.name not in BENCHMARKS:
        args.parser.error(f"unknown benchmark {args.name!r}; choose from "
                          f"{', '.join(BENCHMARKS)}")
    return _delegate(BENCHMARKS[args.name], args.rest)


def _cmd_export(args: argparse.Namespace) -> int:
    from labkit.quant.gguf_export import export_gguf

    chosen = export_gguf(args.model, args.out, type=args.type)
    counts = {t: list(chosen.values()).count(t) for t in sorted(set(chosen.values()))}
    print(f"wrote {args.out} ({args.type}): " + ", ".join(f"{n} x {t}" for t, n in counts.items()))
    return 0


def _add_generate_parser(sub: argparse._SubParsersAction) -> None:
    """``generate``: the one subcommand with many flags of its own (sampling, device, TP)."""
    g = sub.add_parser("generate", help="stream a completion from a model")
    g.add_argument("prompt", metavar="PROMPT")
    g.add_argument("--model", default="labkit-tiny",
                   help="shipped model name or a local Hugging Face folder")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--device", default=None, help="cpu or cuda (default cpu)")
    g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    g.add_argument("--tp", type=int, default=1, metavar="N",
                   help="tensor parallelism: split the model over N worker processes (under "
                   "torchrun: its WORLD_SIZE processes, on any number of nodes)")
    g.add_argument("--enable-expert-parallel", action="store_true",
                   help="with --tp N on an MoE model: place E/N whole experts on each worker "
                   "and move tokens to them by all-to-all (labkit.parallel.expert)")
    g.set_defaults(func=_cmd_generate, parser=g)


def _add_passthrough_parser(sub: argparse._SubParsersAction, name: str, module: str,
                            help: str) -> None:
    """A subcommand whose own module parses its flags: listed in ``--help``, run by ``module``."""
    sp = sub.add_parser(name, help=help, add_help=False)
    sp.add_argument("rest", nargs=argparse.REMAINDER)
    sp.set_defaults(func=lambda a: _delegate(module, a.rest))


def _add_training_parsers(sub: argparse._SubParsersAction) -> None:
    """The subcommands that make models: train, finetune, lora, distill, prune."""
    _add_passthrough_parser(sub, "train", "labkit.train.cli", "train the shipped tiny models")
    _add_passthrough_parser(sub, "finetune", "labkit.train.lora_cli",
                            "train a LoRA / QLoRA adapter: labkit finetune --lora")
    _add_passthrough_parser(sub, "lora", "labkit.lora.cli", "LoRA adapters: labkit lora merge "
                            "--base B --adapter A --out O [--quantize gptq]")
    _add_passthrough_parser(sub, "distill", "labkit.compress.cli",
                            "distill a student from a teacher")
    _add_passthrough_parser(sub, "prune", "labkit.compress.prune_cli",
                            "prune + refit + heal a model")


def _add_bench_and_export_parsers(sub: argparse._SubParsersAction) -> None:
    """``bench NAME`` and ``export gguf``: their arguments are checked here, not delegated."""
    from labkit.bench import BENCHMARKS

    b = sub.add_parser("bench", help=f"run a benchmark: {', '.join(BENCHMARKS)}")
    b.add_argument("name", metavar="NAME", help=f"one of: {', '.join(BENCHMARKS)}")
    b.add_argument("rest", nargs=argparse.REMAINDER,
                   help="benchmark flags, e.g. --quick --json PATH")
    b.set_defaults(func=_cmd_bench, parser=b)

    e = sub.add_parser("export", help="write a model in another format (gguf)")
    e.add_argument("format", choices=["gguf"])
    e.add_argument("model", metavar="MODEL", help="shipped model name or a local HF folder")
    e.add_argument("out", metavar="OUT.gguf")
    e.add_argument("--type", default="f16", choices=["f32", "f16", "q8_0", "q4_0", "q4_k_m"])
    e.set_defaults(func=_cmd_export)


def _add_serving_parsers(sub: argparse._SubParsersAction) -> None:
    """The rest, in ``--help``'s order: serving (serve, router, cluster), drills, profiling."""
    _add_passthrough_parser(sub, "serve", "labkit.serve.launcher",
                            "OpenAI-compatible server: labkit serve MODEL --port P")
    _add_passthrough_parser(sub, "drill", "labkit.exercises.drills", "interview drills by topic")
    _add_passthrough_parser(sub, "router", "labkit.router.proxy",
                            "route over labkit serve replicas")
    _add_passthrough_parser(sub, "profile", "labkit.engine.profile_cli",
                            "where a step's time goes: labkit profile MODEL --batch N --steps K "
                            "[--trace PATH]")
    _add_passthrough_parser(sub, "cluster", "labkit.router.cluster",
                            "N replicas + a router: labkit cluster up N")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="labkit", description="labkit: learn how LLM inference "
                                "gets fast by running real code.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    info = sub.add_parser("info", help="versions, device, interpreter, shipped models")
    info.set_defaults(func=_cmd_info)
    _add_generate_parser(sub)
    _add_training_parsers(sub)
    _add_bench_and_export_parsers(sub)
    _add_serving_parsers(sub)
    return p


_PASSTHROUGH = {"train": "labkit.train.cli", "finetune": "labkit.train.lora_cli",
                "lora": "labkit.lora.cli", "drill": "labkit.exercises.drills",
                "serve": "labkit.serve.launcher", "router": "labkit.router.proxy",
                "distill": "labkit.compress.cli", "prune": "labkit.compress.prune_cli",
                "cluster": "labkit.router.cluster", "profile": "labkit.engine.profile_cli"}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # argparse's REMAINDER drops a leading "--flag"; hand these subcommands their argv whole.
    if argv and argv[0] in _PASSTHROUGH:
        return _delegate(_PASSTHROUGH[argv[0]], argv[1:])
    if len(argv) >= 2 and argv[0] == "bench" and not argv[1].startswith("-"):
        from labkit.bench import BENCHMARKS

        if argv[1] in BENCHMARKS:
            return _delegate(BENCHMARKS[argv[1]], argv[2:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())

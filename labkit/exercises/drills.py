"""``labkit drill [TOPIC]``: interview questions with short answers and runnable snippets.

The bank (``drills_core``, ``drills_models``, ``drills_serving``, ``drills_scale``,
``drills_deploy``) covers the topics of the interview notes the lab was designed from.
``labkit drill`` lists topics; ``labkit drill TOPIC`` prints its questions, answers and snippets;
``--run`` executes the snippets; ``--quiz`` hides the answers until you press Enter;
``--search WORD`` looks through every question and answer; ``--progress`` shows which exercises
pass.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import random
import re
import sys
import textwrap

from labkit.exercises.drills_core import CORE, Drill
from labkit.exercises.drills_deploy import DEPLOY
from labkit.exercises.drills_models import MODELS
from labkit.exercises.drills_scale import SCALE
from labkit.exercises.drills_serving import SERVING

DRILLS: list[Drill] = [*CORE, *MODELS, *SERVING, *SCALE, *DEPLOY]
TOPICS: list[str] = list(dict.fromkeys(drill.topic for drill in DRILLS))
# What people type -> topic.
ALIASES = {
    "paged": "paged-attention", "pagedattention": "paged-attention", "kv": "kv-cache",
    "continuous-batching": "batching", "prefix": "prefix-caching", "scheduler": "scheduling",
    "watermark": "watermarks", "quant": "quantization", "gptq": "quantization",
    "awq": "quantization", "nf4": "quantization", "bitsandbytes": "quantization",
    "spec": "speculative-decoding", "speculative": "speculative-decoding", "ttft": "metrics",
    "tpot": "metrics", "latency": "metrics", "sse": "streaming", "rate-limit": "rate-limiting",
    "mig": "gpu-sharing", "time-slicing": "gpu-sharing", "canary": "releases",
    "gray-release": "releases", "gateway": "gateways", "load-balancing": "gateways",
    "scaling": "autoscaling", "tenants": "multi-tenancy", "tenant": "multi-tenancy",
    "gguf": "llama-cpp", "llama.cpp": "llama-cpp", "ollama": "llama-cpp",
    "trt-llm": "tensorrt-llm", "tensorrt": "tensorrt-llm", "vllm": "frameworks",
    "distillation": "compression", "pruning": "compression",
    "tp": "parallelism", "pp": "parallelism", "tensor-parallel": "parallelism",
    "pipeline-parallel": "parallelism", "safetensors": "weight-loading", "mmap": "weight-loading",
    "cold-start": "weight-loading", "qlora": "lora", "adapters": "lora", "multi-lora": "lora",
    "s-lora": "lora", "mobile": "on-device", "phone": "on-device", "npu": "on-device",
    "edge": "on-device", "moderation": "safety", "guardrails": "safety", "hot-update": "releases",
    "rolling-update": "releases", "blue-green": "releases",
}


def resolve_topic(name: str) -> str:
    """Canonical topic for a name or alias; ValueError listing valid topics otherwise."""
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    if key in TOPICS:
        return key
    if key in ALIASES:
        return ALIASES[key]
    raise ValueError(f"unknown topic {name!r}; valid topics: {', '.join(TOPICS)}")


def drills_for(topic: str) -> list[Drill]:
    topic = resolve_topic(topic)
    return [drill for drill in DRILLS if drill.topic == topic]


def search(word: str) -> list[Drill]:
    """Drills whose topic, question or answer contains ``word`` as a word (so "MIG" does not
    match "might"), case-insensitive; the topic name also matches by prefix."""
    pat = re.compile(rf"(?<![A-Za-z0-9]){re.escape(word)}(?![A-Za-z0-9])", re.IGNORECASE)
    return [x for x in DRILLS if x.topic.startswith(word.lower())
            or pat.search(x.question) or pat.search(x.answer)]


def run_snippet(drill: Drill) -> str:
    """Execute a drill's snippet in a fresh namespace; returns what it printed."""
    if drill.snippet is None:
        return ""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(drill.snippet, f"<drill {drill.id}>", "exec"), {"__name__": "__drill__"})
    return out.getvalue()


def format_drill(drill: Drill, *, show_answer: bool = True, output: str | None = None) -> str:
    wrap = lambda text, indent: textwrap.fill(text, 96, initial_indent=indent,
                                              subsequent_indent=" " * len(indent))
    lines = [f"[{drill.topic} / {drill.id}]", wrap(drill.question, "Q: ")]
    if show_answer:
        lines.append(wrap(drill.answer, "A: "))
    if drill.snippet:
        lines.append("   try it:")
        lines.extend("     " + line for line in drill.snippet.splitlines())
    if output:
        lines.append("   output:")
        lines.extend("     " + line for line in output.rstrip().splitlines())
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="labkit drill", description="Interview drills on LLM inference and serving.",
        epilog="topics: " + ", ".join(TOPICS))
    p.add_argument("topic", nargs="?", help="a topic (or alias); omit to list topics")
    p.add_argument("--run", action="store_true", help="execute each drill's snippet")
    p.add_argument("--quiz", action="store_true",
                   help="show one question at a time; press Enter for the answer")
    p.add_argument("--search", metavar="WORD", help="search questions and answers")
    p.add_argument("--random", action="store_true", help="one random drill")
    p.add_argument("--seed", type=int, default=None, help="seed for --random")
    p.add_argument("--progress", action="store_true",
                   help="show which exercises pass (the local progress file)")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.progress:
        from labkit.exercises.progress import summary

        print(summary())
        return 0
    if args.search:
        chosen = search(args.search)
        if not chosen:
            print(f"no drill mentions {args.search!r}; topics: {', '.join(TOPICS)}")
            return 1
    elif args.topic:
        try:
            chosen = drills_for(args.topic)
        except ValueError as e:
            parser.error(str(e))  # argparse-style: usage + message, exit status 2
    elif args.random:
        chosen = [random.Random(args.seed).choice(DRILLS)]
    else:
        print(f"{len(DRILLS)} drills in {len(TOPICS)} topics "
              "(labkit drill TOPIC [--run] [--quiz], labkit drill --search WORD):")
        for topic in TOPICS:
            n = sum(1 for x in DRILLS if x.topic == topic)
            print(f"  {topic:<22} {n} drill{'s' if n > 1 else ''}")
        return 0
    for i, drill in enumerate(chosen):
        if i:
            print()
        if args.quiz:
            print(format_drill(drill, show_answer=False).split("   try it:")[0])
            if sys.stdin.isatty():
                input("   (Enter for the answer) ")
            print(textwrap.fill(drill.answer, 96, initial_indent="A: ", subsequent_indent="   "))
            continue
        print(format_drill(drill, output=run_snippet(drill) if args.run else None))
    return 0


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

"""``labkit drill [TOPIC]``: interview questions with short answers and runnable snippets.

The bank (``drills_core``, ``drills_models``, ``drills_serving``, ``drills_scale``,
``drills_deploy``) covers the topics of the interview notes the lab was designed from.
``labkit drill`` lists topics; ``labkit drill TOPIC`` prints its questions, answers and snippets;
``--run`` executes the snippets; ``--quiz`` hides the answers until you press Enter;
``--search WORD`` finds drills by id, topic, English word stem or Chinese term, best first;
``--lang zh`` (or ``both``) shows questions and answers in Chinese as asked in interviews there
(``drills_zh_*``); ``--progress`` shows which exercises pass. Every statement a drill makes about a
named system (vLLM, TGI, ...) carries its source in ``drills_sources``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import random
import re
import sys
import textwrap
import unicodedata
from dataclasses import replace

from labkit.exercises.drills_core import CORE, Drill
from labkit.exercises.drills_deploy import DEPLOY
from labkit.exercises.drills_lab import measure_line
from labkit.exercises.drills_models import MODELS
from labkit.exercises.drills_scale import SCALE
from labkit.exercises.drills_serving import SERVING
from labkit.exercises.drills_sources import SOURCES
from labkit.exercises.drills_zh_core import TOPICS_ZH, ZH_CORE
from labkit.exercises.drills_zh_deploy import ZH_DEPLOY
from labkit.exercises.drills_zh_models import ZH_MODELS
from labkit.exercises.drills_zh_scale import ZH_SCALE
from labkit.exercises.drills_zh_serving import ZH_SERVING

LANGS = ("en", "zh", "both")
_ZH = {**ZH_CORE, **ZH_MODELS, **ZH_SERVING, **ZH_SCALE, **ZH_DEPLOY}


def _complete(drill: Drill) -> Drill:
    """Attach the Chinese text and the audited claims; the tests check none is missing."""
    q_zh, a_zh = _ZH.get(drill.id, ("", ""))
    return replace(drill, question_zh=" ".join(q_zh.split()), answer_zh=" ".join(a_zh.split()),
                   claims=tuple(SOURCES.get(drill.id, ())))


DRILLS: list[Drill] = [_complete(x) for x in (*CORE, *MODELS, *SERVING, *SCALE, *DEPLOY)]
TOPICS: list[str] = list(dict.fromkeys(drill.topic for drill in DRILLS))
BY_ID: dict[str, Drill] = {drill.id: drill for drill in DRILLS}
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


def _topic_or_none(name: str) -> str | None:
    key = name.strip().lower().replace("_", "-").replace(" ", "-")
    if key in TOPICS:
        return key
    if key in ALIASES:
        return ALIASES[key]
    by_zh = {"".join(v.split()): k for k, v in TOPICS_ZH.items()}
    return by_zh.get("".join(name.split()))


def resolve_topic(name: str) -> str:
    """Canonical topic for a name, alias or Chinese topic name; ValueError listing valid
    topics otherwise."""
    topic = _topic_or_none(name)
    if topic is None:
        raise ValueError(f"unknown topic {name!r}; valid topics: {', '.join(TOPICS)}")
    return topic


def drills_for(topic: str) -> list[Drill]:
    topic = resolve_topic(topic)
    return [drill for drill in DRILLS if drill.topic == topic]


_SUFFIXES = ("ations", "ation", "ions", "ion", "ings", "ing", "ers", "er", "ed", "es", "s", "e")
_CJK = re.compile(r"[\u3400-\u9fff\uf900-\ufaff]")


def stem(word: str) -> str:
    """Lower-case and strip one common English suffix, keeping at least three letters:
    preemption, preempted, preempts -> preempt; cache, caches, caching -> cach. Crude on
    purpose (no dictionary): the query and the text go through the same function, so they
    meet even where the stem is not a word."""
    w = word.lower()
    if not w.isalpha():
        return w
    for suffix in _SUFFIXES:
        if w.endswith(suffix) and len(w) - len(suffix) >= 3:
            return w[: -len(suffix)]
    return w


def _stems(text: str) -> list[str]:
    return [stem(w) for w in re.findall(r"[A-Za-z0-9]+", text)]


def _contains(haystack: list[str], needle: list[str]) -> bool:
    n = len(needle)
    return n > 0 and any(haystack[i:i + n] == needle for i in range(len(haystack) - n + 1))


def _score(drill: Drill, query: str) -> int:
    """How well ``drill`` matches: 8 for its id, 4 for its topic, 2 for its question, 1 for
    its answer (the sum, so a drill named after the word ranks before drills that mention it).
    Chinese queries match the Chinese text, ignoring spaces (KV缓存 = KV 缓存)."""
    if _CJK.search(query):
        q = "".join(query.lower().split())
        flat = lambda text: "".join(text.lower().split())  # noqa: E731
        return (4 * (q in flat(TOPICS_ZH.get(drill.topic, ""))) + 2 * (q in flat(drill.question_zh))
                + (q in flat(drill.answer_zh)))
    words = _stems(query)
    topic = _topic_or_none(query)
    return (8 * _contains(_stems(drill.id), words)
            + 4 * (drill.topic == topic or drill.topic.startswith(query.strip().lower())
                   or _contains(_stems(drill.topic), words))
            + 2 * _contains(_stems(drill.question), words) + _contains(_stems(drill.answer), words))


def search(word: str) -> list[Drill]:
    """Drills matching ``word`` in their id, topic (or a topic alias), question or answer, best
    first. English matches whole words by stem (so "MIG" does not match "might", and "preempt"
    finds "preemption"); a phrase matches its words in order; Chinese matches the Chinese text."""
    if not word.strip():
        raise ValueError("empty search; give a word such as 'preemption' or '前缀缓存'")
    scored = [(_score(x, word), i, x) for i, x in enumerate(DRILLS)]
    return [x for score, _, x in sorted(scored, key=lambda t: (-t[0], t[1])) if score]


def run_snippet(drill: Drill) -> str:
    """Execute a drill's snippet in a fresh namespace; returns what it printed."""
    if drill.snippet is None:
        return ""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(drill.snippet, f"<drill {drill.id}>", "exec"), {"__name__": "__drill__"})
    return out.getvalue()


_LABELS = {"en": ("Q: ", "A: ", "try it:", "output:"),
           "zh": ("问：", "答：", "动手试试：", "输出：")}
_NO_BREAK_BEFORE = set("，。、；：！？）》」』”’,.;:!?)")
_NO_BREAK_AFTER = set("（《「『“‘")


def _width(text: str) -> int:
    """Terminal columns: CJK characters and full-width punctuation take two."""
    return sum(2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in text)


def wrap(text: str, indent: str, width: int = 96) -> str:
    """textwrap.fill for mixed Chinese and English: breaks between any two CJK characters (they
    have no spaces between them), never inside an English word or number, never before closing
    or after opening punctuation (the neighbouring character moves down with it); counts a CJK
    character as two columns."""
    if not _CJK.search(text):
        return textwrap.fill(text, width, initial_indent=indent, break_on_hyphens=False,
                             subsequent_indent=" " * _width(indent))
    pad = " " * _width(indent)
    lines: list[list[str]] = [[indent]]
    for unit in re.findall(r"[\x21-\x7e]+ *|\S *| +", text):
        line = lines[-1]
        if _width("".join(line) + unit.rstrip()) <= width or len(line) == 1:
            line.append(unit)
            continue
        moved = [unit]
        while len(line) > 2 and (moved[0][0] in _NO_BREAK_BEFORE
                                 or line[-1].rstrip()[-1:] in _NO_BREAK_AFTER):
            moved.insert(0, line.pop())
        lines.append([pad, moved[0].lstrip(), *moved[1:]])
    return "\n".join("".join(line).rstrip() for line in lines)


def _text(drill: Drill, lang: str) -> list[tuple[str, str, str]]:
    """(label, question, answer) per language shown, Chinese first when both."""
    if lang not in LANGS:
        raise ValueError(f"unknown language {lang!r}; choose one of {', '.join(LANGS)}")
    zh = ("zh", drill.question_zh, drill.answer_zh)
    en = ("en", drill.question, drill.answer)
    return {"en": [en], "zh": [zh], "both": [zh, en]}[lang]


def format_drill(drill: Drill, *, show_answer: bool = True, output: str | None = None,
                 lang: str = "en", sources: bool = False) -> str:
    """The drill as ``labkit drill`` prints it; ``lang`` is en, zh or both (Chinese, then the
    English original); ``sources`` adds where each statement about a named system comes from."""
    texts = _text(drill, lang)
    lines = [format_question(drill, lang)]
    if show_answer:
        lines += [wrap(answer, _LABELS[code][1]) for code, _, answer in texts]
    if sources and drill.claims:
        lines.append("   " + ("来源：" if texts[0][0] == "zh" else "sources:"))
        lines += [wrap(f"{c.system}: {c.claim}. {c.source}", "     - ") for c in drill.claims]
    try_it, out_label = _LABELS[texts[0][0]][2:]
    if drill.snippet:
        lines.append("   " + try_it)
        lines.extend("     " + line for line in drill.snippet.splitlines())
    if output:
        lines.append("   " + out_label)
        lines.extend("     " + line for line in output.rstrip().splitlines())
    measure = measure_line(drill.id, texts[0][0])
    if measure and show_answer:
        lines.append("   " + measure)
    return "\n".join(lines)


def format_question(drill: Drill, lang: str = "en") -> str:
    """The header and question(s) alone: what --quiz shows before the learner answers."""
    questions = [wrap(q, _LABELS[code][0]) for code, q, _ in _text(drill, lang)]
    return "\n".join([f"[{drill.topic} / {drill.id}]", *questions])


def format_answer(drill: Drill, lang: str = "en") -> str:
    """Only the answer(s), for --quiz after the learner pressed Enter."""
    return "\n".join(wrap(answer, _LABELS[code][1]) for code, _, answer in _text(drill, lang))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="labkit drill", description="Interview drills on LLM inference and serving.",
        epilog="topics: " + ", ".join(TOPICS))
    p.add_argument("topic", nargs="?",
                   help="a topic (alias, Chinese name) or one drill's id; omit to list topics")
    p.add_argument("--run", action="store_true", help="execute each drill's snippet")
    p.add_argument("--sources", action="store_true",
                   help="show where each statement about a named system (vLLM, TGI, ...) comes "
                        "from: a repository path or documentation page")
    p.add_argument("--quiz", action="store_true",
                   help="show one question at a time; press Enter for the answer")
    p.add_argument("--search", metavar="WORD",
                   help="search ids, topics, questions and answers (English word stems, or "
                        "Chinese terms such as 前缀缓存)")
    p.add_argument("--lang", choices=LANGS, default="en",
                   help="language of questions and answers: en, zh (中文) or both")
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
    elif args.topic in BY_ID:  # one drill by its id: labkit drill sched-preempt
        chosen = [BY_ID[args.topic]]
    elif args.topic:
        try:
            chosen = drills_for(args.topic)
        except ValueError as e:
            parser.error(str(e))  # argparse-style: usage + message, exit status 2
    elif args.random:
        chosen = [random.Random(args.seed).choice(DRILLS)]
    else:
        _list_topics(args.lang)
        return 0
    for i, drill in enumerate(chosen):
        if i:
            print()
        if args.quiz:
            print(format_question(drill, args.lang))
            if sys.stdin.isatty():
                input("   (Enter for the answer) ")
            print(format_answer(drill, args.lang))
            continue
        output = run_snippet(drill) if args.run else None
        print(format_drill(drill, output=output, lang=args.lang, sources=args.sources))
    return 0


def _list_topics(lang: str) -> None:
    print(f"{len(DRILLS)} drills in {len(TOPICS)} topics "
          "(labkit drill TOPIC [--run] [--quiz] [--lang zh], labkit drill --search WORD):")
    for topic in TOPICS:
        n = sum(1 for x in DRILLS if x.topic == topic)
        zh = f"  {TOPICS_ZH[topic]}" if lang != "en" else ""
        print(f"  {topic:<22} {n} drill{'s' if n > 1 else ' '}{zh}")


if __name__ == "__main__":  # pragma: no cover
    raise SystemExit(main())

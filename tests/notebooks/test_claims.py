"""What notebook 06 and the exercise notebooks say about named systems (vLLM, llama.cpp,
FlashAttention, the H200, ...) is either cited in the same markdown cell (a URL, or
``owner/repo: path`` as in labkit/exercises/drills_sources.py), labelled *Background*, or checked
by an ``assert`` in the code cell right before or after it. The drills notebook is covered by
tests/exercises/test_drills.py (every drill naming a system has a Claim with its source).

The second half (issue 27) pins claims a reader found out of date: each test fails on the old
wording and requires the corrected fact in the drill, its Chinese twin, its sources and the module
docstring or notebook cell that states it (the autoscaling one against the simulator's own run)."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from labkit.exercises.drills_sources import SYSTEMS

ROOT = Path(__file__).resolve().parents[2]
# every exercise notebook (01-13) follows this rule (issue 19); a new one joins by raising the bound
NOTEBOOKS = [ROOT / "notebooks" / "06_triton_kernels.ipynb"] + [
    p for p in sorted((ROOT / "notebooks" / "exercises").glob("[01][0-9]_*.ipynb"))
    if int(p.stem[:2]) <= 13]
# hardware and papers the notebooks state facts about, beside the drills' system names
NAMED = {**SYSTEMS, "FlashAttention": r"\bFlashAttention\b", "ggml": r"\bggml\b",
         "H100/H200/Hopper": r"\bH[12]00\b|\bHopper\b", "tensor cores": r"\btensor cores\b",
         "Blackwell": r"\bBlackwell\b|\bG?B[23]00\b", "NVFP4/MXFP4": r"\b(NV|MX)FP4\b"}
CITATION = re.compile(r"https?://\S+|\b[\w.-]+/[\w.-]+: \S+|\*Background")


def _checked(cells: list, i: int) -> bool:
    near = [cells[j] for j in (i - 1, i + 1) if 0 <= j < len(cells)]
    return any(c.cell_type == "code" and re.search(r"^\s*assert\b", c.source, re.M)
               for c in near)


def _uncited(path: Path) -> list[str]:
    cells = nbformat.read(path, as_version=4).cells
    bad = []
    for i, cell in enumerate(cells):
        if cell.cell_type != "markdown":
            continue
        names = [n for n, rx in NAMED.items() if re.search(rx, cell.source)]
        if names and not CITATION.search(cell.source) and not _checked(cells, i):
            bad.append(f"{cell.id} names {names}")
    return bad


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_claims_about_named_systems_are_cited_or_checked(path):
    bad = _uncited(path)
    assert not bad, f"{path.name}: cite (URL or owner/repo: path), label *Background*, or " \
        f"assert next to: {bad}"


def test_the_rule_catches_an_uncited_claim(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("vLLM preallocates KV contiguously.", id="m1"),
                nbformat.v4.new_code_cell("print(1)", id="c1"),
                nbformat.v4.new_markdown_cell("FlashAttention, see https://arxiv.org/abs/2205"
                                              ".14135", id="m2"),
                nbformat.v4.new_markdown_cell("An H200 streams at 4.8 TB/s.", id="m3"),
                nbformat.v4.new_code_cell("assert bandwidth > 4e12", id="c3")]
    path = tmp_path / "nb.ipynb"
    nbformat.write(nb, path)
    assert _uncited(path) == ["m1 names ['vLLM']"]


# --- Claims brought up to date (issue 27) ---------------------------------------------------------
# Each test fails on the wording a reader found wrong and requires the corrected fact, in the
# English drill, its Chinese twin, the sources behind them and the module or notebook that says it.

from labkit.exercises.drills import BY_ID, DRILLS, run_snippet  # noqa: E402
from labkit.sched import scheduler  # noqa: E402
from labkit.sim import autoscaler  # noqa: E402
from labkit.sim.cost import max_kv_tokens  # noqa: E402
from labkit.sim.presets import get_gpu, get_model_preset  # noqa: E402

README = (ROOT / "README.md").read_text(encoding="utf-8")


def _markdown(name: str, cell_id: str) -> str:
    cells = nbformat.read(ROOT / "notebooks" / name, as_version=4).cells
    (cell,) = [c for c in cells if c.get("id") == cell_id]
    assert cell.cell_type == "markdown"
    return " ".join(cell.source.split())


def _sources(drill) -> str:
    return " ".join(f"{c.system} {c.claim} {c.source}" for c in drill.claims)


def _readme_paragraphs() -> list[str]:
    """README prose paragraphs (indented code blocks and fenced blocks left out)."""
    text = re.sub(r"```.*?```", "", README, flags=re.S)
    paras = re.split(r"\n\s*\n", "\n".join(ln for ln in text.splitlines()
                                            if not ln.startswith("    ")))
    return [" ".join(p.split()) for p in paras if p.strip()]


def test_watermark_hysteresis_is_the_textbook_rule_and_tgi_admits_by_token_budget():
    doc = " ".join(scheduler.__doc__.split())
    for text in (doc, *(x.answer for x in DRILLS), *_readme_paragraphs()):
        assert not re.search(r"TGI[- ](style|like) hysteresis", text), text[:120]
    assert "hysteresis, the textbook technique; neither TGI nor vLLM does this" in doc
    assert re.search(r"TGI admits by token budget.*max_new_tokens.*never preempts", doc)
    assert re.search(r"vLLM V0 kept a single watermark.*V1 keeps none", doc)
    answer = BY_ID["watermark"].answer  # the drill the docstring points at says the same
    assert "textbook technique is hysteresis" in answer and "admits by token budget" in answer


@pytest.mark.parametrize("drill", DRILLS, ids=lambda x: x.id)
def test_tgi_is_named_with_its_maintenance_mode(drill):
    """TGI entered maintenance mode on 2025-12-11 (its README); wherever a drill names it, in
    either language or in the sources `--sources` prints, the learner reads that too."""
    if re.search(r"\bTGI\b", drill.answer):
        assert "maintenance mode since December 2025" in drill.answer
    if re.search(r"\bTGI\b", drill.answer_zh):
        assert "2025 年十二月起" in drill.answer_zh and "维护模式" in drill.answer_zh
    named = re.search(r"\bTGI\b", drill.answer) or any(c.system == "TGI" or "TGI" in c.claim
                                                        for c in drill.claims)
    if named:
        assert "maintenance-mode notice" in _sources(drill), drill.id


def test_tgi_drills_exist_and_readme_says_maintenance_mode():
    tgi = {x.id for x in DRILLS if re.search(r"\bTGI\b", x.answer + _sources(x))}
    assert {"watermark", "quant-tools", "monitoring"} <= tgi  # the rule above is not vacuous
    assert "vLLM or SGLang" in BY_ID["quant-tools"].answer  # the current choices come first
    for para in _readme_paragraphs():
        if re.search(r"\bTGI\b", para):
            assert "maintenance mode since December 2025" in para, para[:120]


def test_llama_cpp_offload_fits_automatically_and_per_tensor():
    drill = BY_ID["llama-cpp-offload"]
    for text in (drill.answer, drill.answer_zh):
        for flag in ("--fit", "-ngl auto", "--override-tensor", "--n-cpu-moe", "--cpu-moe"):
            assert flag in text, flag
    assert "offloads as many transformer layers as fit to the GPU (n_gpu_layers)" not in \
        drill.answer  # the old, manual-only story
    assert re.search(r"--fit \(on by default\)", drill.answer)
    src = _sources(drill)
    assert "--fit" in src and "--n-cpu-moe" in src and "--override-tensor" in src
    out = run_snippet(drill)  # the MoE split the answer describes, computed
    share = float(re.search(r"experts (\d+)% of the weights", out).group(1))
    assert share > 90


def test_preemption_by_recompute_does_not_retire_kv_offload_to_cpu():
    drill = BY_ID["sched-preempt"]
    assert "its V1 engine only recomputes," not in drill.answer  # read as "KV never leaves"
    assert re.search(r"V1 engine only preempts by recompute", drill.answer)
    assert re.search(r"KV still moves to CPU memory in V1.*offloading KV connector.*LMCache",
                     drill.answer)
    assert "卸载连接器" in drill.answer_zh and "LMCache" in drill.answer_zh
    assert "offloading_connector.py" in _sources(drill)
    doc = " ".join(scheduler.__doc__.split())
    assert "offloading KV connector" in doc


def test_kv_pool_minus_profiled_activations_and_labkit_ignores_them():
    md = _markdown("01_kv_cache_and_paging.ipynb", "46815861")
    assert "a fraction of GPU memory minus the weights —" not in md  # the old, partial rule
    assert re.search(r"minus the weights minus the \*\*peak activation memory of a profiling run",
                     md)
    assert "it ignores activations" in md and "upper bound" in md
    assert "vllm/v1/worker/gpu_worker.py" in md
    # ... and labkit really does ignore them: weights alone come off the pool
    m, g = get_model_preset("llama-2-7b"), get_gpu("a100-80gb")
    assert max_kv_tokens(m, g) == int((0.9 * g.mem_bytes - m.weight_bytes) // m.kv_bytes_per_token)
    drill = BY_ID["kv-capacity"]
    assert "peak activation memory of a profiling run" in drill.answer
    assert "upper bound" in drill.answer and "激活值" in drill.answer_zh
    assert "profiling run" in _sources(drill)


def test_mmap_overlaps_io_with_compute_but_the_first_token_needs_every_layer():
    md = _markdown("11_llama_cpp_and_gguf.ipynb", "cell-14")
    assert not re.search(r"(?<!not )lets? the first token start before every byte", md)
    assert "does not let a dense model's first token start before every byte is in" in md
    assert "every layer" in md and "overlap" in md


def test_hardware_lists_include_blackwell_and_fp4():
    texts = [(x.id, lang, t) for x in DRILLS
             for lang, t in (("en", x.answer), ("zh", x.answer_zh), ("src", _sources(x)))]
    for drill_id, lang, text in texts:
        if re.search(r"\bMIG\s*[(（]", text) or (lang == "src" and "isolated instances" in text):
            assert all(g in text for g in ("B200", "GB200", "B300")), (drill_id, lang)
        if "FP8" in text and "Hopper" in text:
            assert "Blackwell" in text and "FP4" in text, (drill_id, lang)
        # FP4 tensor-core math is Blackwell's; Hopper only dequantizes FP4 weights
        for m in re.finditer(r"[^.;。；]*Hopper[^.;。；]*FP4[^.;。；]*", text):
            assert re.search(r"\bno FP4|没有 FP4", m.group()), (drill_id, lang, m.group())
    quant = BY_ID["quant-tools"].answer
    assert "Hopper has FP8 but no FP4 tensor cores" in quant and "NVFP4, MXFP4" in quant
    assert "FP8 in TensorRT-LLM or vLLM on Hopper GPUs" not in quant  # the old, Hopper-only list
    assert "MIG (A100/H100/H200)" not in BY_ID["mig"].answer
    assert "'B200': ['2g.45gb'" in run_snippet(BY_ID["mig"])  # a B200 slice, computed


def test_autoscaling_story_is_one_and_the_simulator_shows_it():
    """The drill and labkit.sim.autoscaler tell one story: arrivals lead, queue length and TTFT
    lag them and arrive with the SLO breach; the numbers both quote are the drill's own run."""
    drill, doc = BY_ID["autoscale"], " ".join(autoscaler.__doc__.split())
    assert "signals that lead latency" not in drill.answer  # the old claim
    assert "Queue length and TTFT do not lead latency, they are latency" in drill.answer
    assert re.search(r"they move after the arrivals do and together with the SLO breach",
                     drill.answer)
    assert "forecast" in drill.answer and "forecast" in doc
    assert "it lags the arrivals and comes with the SLO breach, not before it" in doc
    assert "领先信号" in drill.answer_zh and "之后才动" in drill.answer_zh
    out = run_snippet(drill)
    t = dict(zip(("rate", "miss", "queue", "seen"), map(float, re.search(
        r"capacity at ([\d.]+) s, first request over the 0.25 s TTFT SLO arrives at ([\d.]+) s, "
        r"queue >= 4 at ([\d.]+) s, TTFT shows the miss at ([\d.]+) s", out).groups())))
    assert t["rate"] < t["miss"] and abs(t["queue"] - t["miss"]) <= 0.5 < t["seen"] - t["rate"]
    lead = float(re.search(r"arrivals cross capacity ([\d.]+) s before the first request", doc)
                 .group(1))
    assert abs(lead - (t["miss"] - t["rate"])) < 0.01
    assert "the queue reaches 4 within 0.5 s of that miss" in doc
    assert re.search(r"the queue reached 4 requests only around the first miss", drill.answer)


def test_decode_first_says_which_vllm_scheduler():
    drill = BY_ID["sched-decode-first"]
    assert re.search(r"That is vLLM's V1 scheduler, and its V0 scheduler with chunked prefill",
                     drill.answer)
    assert re.search(r"V0's default scheduler \(chunked prefill off\) did the opposite: it "
                     r"batched as many waiting prefills as fit first", drill.answer)
    assert "V0 的默认调度器" in drill.answer_zh and "正好相反" in drill.answer_zh
    assert "_schedule_default" in _sources(drill)
    doc = " ".join(scheduler.__doc__.split())
    assert "the way vLLM's V1 scheduler does" in doc and "V0's default scheduler" in doc


def _conflated(text: str) -> list[str]:
    """Sentences that credit Sarathi(-Serve) with disaggregation, and paragraphs that mention
    prefill/decode disaggregation without citing DistServe and Splitwise."""
    bad = [s for s in re.split(r"(?<=[.;。；])\s*", text)
           if re.search(r"Sarathi", s) and re.search(r"disaggregat|分离", s)]
    if re.search(r"disaggregat|PD 分离", text) and not ("DistServe" in text
                                                          and "Splitwise" in text):
        bad.append("disaggregation without DistServe and Splitwise")
    return bad


def _all_prose() -> list[tuple[str, str]]:
    out = [(f"drill {x.id} {lang}", t) for x in DRILLS
           for lang, t in (("en", x.answer), ("zh", x.answer_zh))]
    out += [("README", p) for p in _readme_paragraphs()]
    for path in sorted((ROOT / "notebooks").rglob("*.ipynb")):
        for cell in nbformat.read(path, as_version=4).cells:
            if cell.cell_type == "markdown":
                out.append((f"{path.name} {cell.get('id')}", " ".join(cell.source.split())))
    return out


def test_disaggregation_is_distserve_and_splitwise_and_sarathi_is_chunked_prefill():
    bad = [(where, b) for where, text in _all_prose() for b in _conflated(text)]
    assert not bad, bad
    drill = BY_ID["sched-decode-first"]
    for text in (drill.answer, drill.answer_zh):
        assert all(n in text for n in ("Sarathi-Serve", "DistServe", "Splitwise"))
    assert re.search(r"Sarathi-Serve \(OSDI'24\) calls stall-free batching", drill.answer)
    src = _sources(drill)
    assert "2403.02310" in src and "2401.09670" in src and "2311.18677" in src
    # the rule catches the conflation the issue describes
    assert _conflated("Sarathi-Serve split prefill from decode (disaggregation).")
    assert _conflated("Prefill/decode disaggregation puts them on separate GPUs.")
    assert not _conflated(drill.answer)

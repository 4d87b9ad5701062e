"""Third-party clients against labkit's server, each from its own venv (tests/serve/run_clients.sh
makes it): lm-evaluation-harness's ``local-completions`` model and guidellm's benchmark.

lm-eval is the tool the notes' "run the eval set after quantizing" means; its multiple-choice
scoring is ``echo`` + ``logprobs`` on the server (issue 32), so every loglikelihood it logs is
compared with labkit's in-process float32 scoring of the same item, and its greedy completions
with ``LLM.generate``. guidellm must finish a run with no errored request and count the tokens the
server reported."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from labkit.bench.lm_eval_tasks import LINE_FILE, MC_FILE, greedy_lines, load_items, score_choices
from labkit.engine.llm import LLM
from labkit.engine.llm_engine import LLMEngine
from labkit.paths import DATASETS_DIR, REPO_ROOT
from labkit.serve.api_server import ServeConfig
from labkit.serve.launcher import ServerThread

# absolute: lm_eval and guidellm run with their work folder as the current directory
VENV = Path(os.environ.get("LABKIT_CLIENTS_VENV") or REPO_ROOT / ".venv-clients").absolute()
TOKENIZER = str(DATASETS_DIR / "models" / "labkit-tiny")
LIMIT = 10
pytestmark = [
    pytest.mark.interop,
    pytest.mark.skipif(not (Path(VENV) / "bin" / "lm_eval").exists(),
                       reason=f"no {VENV}: run tests/serve/run_clients.sh (lm-eval, guidellm)"),
]
OFFLINE = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="0")


@pytest.fixture(scope="module")
def server(labkit_tiny):
    m, tok = labkit_tiny
    eng = LLMEngine.from_model(m, tok, block_size=16, num_blocks=256, max_num_seqs=8)
    with ServerThread(eng, tok, ServeConfig(model_name="labkit-tiny")) as srv:
        yield srv


@pytest.fixture(scope="module")
def lm_eval_samples(server, tmp_path_factory) -> dict[str, list[dict]]:
    from labkit.bench.lm_eval_tasks import write_task_yaml

    work = tmp_path_factory.mktemp("lm_eval")
    tasks = write_task_yaml(work / "tasks", limit=LIMIT)
    args = ",".join([f"base_url={server.url}/v1/completions", "model=labkit-tiny",
                     "tokenizer_backend=huggingface", f"tokenizer={TOKENIZER}",
                     "num_concurrent=1", "max_retries=1", "tokenized_requests=True"])
    run = subprocess.run([f"{VENV}/bin/lm_eval", "--model", "local-completions", "--model_args",
                          args, "--include_path", str(tasks), "--tasks",
                          "labkit_code_mc,labkit_code_line", "--output_path", str(work / "out"),
                          "--log_samples"], capture_output=True, text=True, timeout=900,
                         env=OFFLINE, cwd=work)
    assert run.returncode == 0, run.stderr[-3000:]
    out = {}
    for task in ("labkit_code_mc", "labkit_code_line"):
        (path,) = (work / "out").rglob(f"samples_{task}_*.jsonl")
        out[task] = sorted((json.loads(s) for s in path.read_text().splitlines()),
                           key=lambda r: r["doc_id"])
    return out


def test_lm_eval_loglikelihoods_equal_in_process_scoring(lm_eval_samples, labkit_tiny):
    model, tok = labkit_tiny
    rows = lm_eval_samples["labkit_code_mc"]
    items = load_items(MC_FILE)[:LIMIT]
    assert [r["doc"] for r in rows] == items
    for r, item in zip(rows, items):
        served = [float(resp[0][0]) for resp in r["resps"]]  # [[ll, is_greedy]] as text
        mine = score_choices(model, tok, item)
        # the server's packed, paged prefill vs one plain forward: float32 reordering only
        assert served == pytest.approx(mine, rel=1e-4, abs=1e-3), (item["source"], served, mine)
        margin = sorted(mine)[-1] - sorted(mine)[-2]
        if margin > 1e-2:  # the same answer, hence the same accuracy
            assert r["acc"] == float(mine.index(max(mine)) == item["label"])


def test_lm_eval_greedy_completions_equal_llm_generate(lm_eval_samples, labkit_tiny):
    model, tok = labkit_tiny
    rows = lm_eval_samples["labkit_code_line"]
    items = load_items(LINE_FILE)[:LIMIT]
    served = [r["resps"][0][0] for r in rows]
    mine = greedy_lines(LLM(model=model, tokenizer=tok, block_size=16, num_blocks=256), tok,
                        items)
    assert served == mine
    assert [r["exact_match"] for r in rows] == [float(s.strip() == x["target"].strip())
                                                 for s, x in zip(served, items)]


def test_guidellm_benchmark_completes_without_errors(server, tmp_path):
    run = subprocess.run(
        [f"{VENV}/bin/guidellm", "run", "--backend",
         f"kind=openai_http,target={server.url},model=labkit-tiny",
         "--profile", "kind=concurrent,streams=2", "--constraint", "kind=max_requests,count=8",
         "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
         "--tokenizer", f"kind=huggingface_auto,model={TOKENIZER}", "--output", "kind=json",
         "--disable-console-interactive"],
        capture_output=True, text=True, timeout=600, env=OFFLINE, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    (bench,) = json.loads((tmp_path / "benchmarks.json").read_text())["benchmarks"]
    made = bench["scheduler_metrics"]["requests_made"]
    assert made["errored"] == made["incomplete"] == 0 and made["successful"] >= 8, made
    tokens = bench["metrics"]["output_token_count"]["successful"]
    assert tokens["mean"] == 16, tokens   # max_tokens honoured, usage reported

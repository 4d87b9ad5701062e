"""``labkit bench lm-eval``: the notes' "run the eval set after quantizing" as a measurement.

For labkit-tiny in float32, INT8, INT4 (round to nearest) and GPTQ (4-bit, calibrated on the
training split), one run starts ``labkit serve`` with the matching ``--quantization`` flag,
points lm-evaluation-harness (``local-completions``, from its own venv: tests/serve/run_clients.sh
makes ``.venv-clients``) at it for the multiple-choice task of held-out Python
(:mod:`labkit.bench.lm_eval_tasks`), and scores the same items in process with the same
quantized weights. Reported per format: lm-eval's accuracy, the in-process accuracy, the largest
difference between the two loglikelihoods of any choice, and the accuracy change against float32.

``outputs_match`` says the server path and the in-process path agree on every item: the same
choice picked wherever the top two choices are more than 1e-2 apart, and for float32 every
loglikelihood within 1e-3. The quantized formats' loglikelihoods are not expected that close, and
the report says by how much they differ (``max_ll_diff``): on CPU an INT8/INT4/GPTQ linear with
more than 8 rows runs torch's packed kernel on bfloat16 activations, with 8 or fewer labkit's
float32 GEMV (labkit/quant/cpu_packed.py, cpu_gemv.py), so how the server chunks a prompt
changes the rounding of some rows, and one forward over the whole sequence does not.
What this does not show: a 40-item task has a standard error of about 7 points at these
accuracies, so a difference of one or two items between formats is noise; the per-item
loglikelihood shift (``mean_abs_ll_shift_vs_fp32``) is the finer signal.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from labkit.bench.common import bench_parser, environment, print_table, write_results
from labkit.bench.lm_eval_tasks import MC_FILE, load_items, score_choices, write_task_yaml
from labkit.paths import REPO_ROOT

FORMATS = {"fp32": None, "int8": "int8", "int4": "int4", "gptq": "gptq"}
TASK = "labkit_code_mc"


def clients_venv() -> Path:
    return Path(os.environ.get("LABKIT_CLIENTS_VENV") or REPO_ROOT / ".venv-clients").absolute()


def prepare(fmt: str, work: Path) -> tuple[str, list[str], torch.nn.Module, Any]:
    """(server MODEL argument, its flags, the same quantized model in process, tokenizer)."""
    from labkit.model.loader import load_pretrained, resolve_model_path
    from labkit.quant.model import quantize_model

    model, tok = load_pretrained("labkit-tiny", dtype=torch.float32)
    if fmt == "fp32":
        return "labkit-tiny", [], model, tok
    if fmt in ("int8", "int4"):
        q = quantize_model(model, {"int8": "int8", "int4": "int4_rtn"}[fmt], group_fallback=True)
        return "labkit-tiny", ["--quantization", fmt], q, tok
    from labkit.quant.calib import corpus_windows
    from labkit.quant.checkpoint import load_quantized, save_quantized
    from labkit.quant.model import gptq_quantize_model

    calib = corpus_windows(tok, "train", 32, 128)
    # one group size for every layer (a checkpoint holds one format); 64 divides each width
    q, _ = gptq_quantize_model(model, calib, group_size=64, progress=False)
    folder = save_quantized(q, work / "tiny-gptq", resolve_model_path("labkit-tiny"))
    return str(folder), ["--quantization", "gptq"], load_quantized(folder), tok


def run_lm_eval(url: str, tasks: Path, out: Path) -> list[dict]:
    """lm-eval's per-item records (``--log_samples``) for the multiple-choice task."""
    venv = clients_venv()
    args = ",".join([f"base_url={url}/v1/completions", "model=labkit-tiny",
                     "tokenizer_backend=huggingface",
                     f"tokenizer={REPO_ROOT / 'datasets' / 'models' / 'labkit-tiny'}",
                     "num_concurrent=1", "max_retries=1", "tokenized_requests=True"])
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    run = subprocess.run([str(venv / "bin" / "lm_eval"), "--model", "local-completions",
                          "--model_args", args, "--include_path", str(tasks), "--tasks", TASK,
                          "--output_path", str(out), "--log_samples"], capture_output=True,
                         text=True, timeout=1800, env=env, cwd=out.parent)
    if run.returncode:  # lm-eval's first error, not the retry noise after it
        errors = [ln for ln in run.stderr.splitlines() if "Error" in ln or "error" in ln]
        raise RuntimeError("lm_eval failed:\n" + "\n".join(errors[:10]) + "\n...\n" +
                           run.stderr[-1500:])
    (path,) = out.rglob(f"samples_{TASK}_*.jsonl")
    return sorted((json.loads(s) for s in path.read_text().splitlines()),
                  key=lambda r: r["doc_id"])


def compare_format(fmt: str, items: list[dict], tasks: Path, work: Path) -> dict[str, Any]:
    from labkit.serve.process import ServerProcess

    model_arg, flags, model, tok = prepare(fmt, work)
    with ServerProcess(model_arg, [*flags, "--dtype", "float32", "--served-model-name",
                                   "labkit-tiny"], threads=None) as srv:
        rows = run_lm_eval(srv.url, tasks, work / f"out-{fmt}")
    served = [[float(r[0][0]) for r in row["resps"]] for row in rows]
    mine = [score_choices(model, tok, it) for it in items]
    diff = max(abs(a - b) for s, m in zip(served, mine) for a, b in zip(s, m))
    picked = [m.index(max(m)) for m in mine]
    clear = [sorted(m)[-1] - sorted(m)[-2] > 1e-2 for m in mine]
    agree = all(r["acc"] == float(p == it["label"]) for r, p, it, c in
                zip(rows, picked, items, clear) if c)
    ll_ok = diff < 1e-3 or fmt != "fp32"  # see the module docstring for the quantized paths
    return {"format": fmt, "lm_eval_acc": sum(r["acc"] for r in rows) / len(rows),
            "in_process_acc": sum(p == it["label"] for p, it in zip(picked, items)) / len(items),
            "max_ll_diff": diff, "agree": bool(agree and ll_ok), "_ll": mine}


def chart(res: dict[str, Any], path: Path) -> None:
    import plotly.graph_objects as go

    rows = res["rows"]
    fig = go.Figure()
    fig.add_bar(x=[r["format"] for r in rows], y=[r["lm_eval_acc"] for r in rows],
                name="lm-eval through labkit serve")
    fig.add_bar(x=[r["format"] for r in rows], y=[r["in_process_acc"] for r in rows],
                name="in-process scoring")
    fig.update_layout(barmode="group", yaxis_title="accuracy", height=340, width=640,
                      title=f"{TASK}: {res['num_items']} items")
    fig.write_html(path)


def main(argv: list[str] | None = None) -> int:
    p = bench_parser("lm-eval", __doc__.split("\n\n")[0])
    args = p.parse_args(argv)
    if not (clients_venv() / "bin" / "lm_eval").exists():
        print(f"no lm-eval in {clients_venv()}: run tests/serve/run_clients.sh --install-only")
        return 2
    items = load_items(MC_FILE)[:12 if args.quick else None]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        tasks = write_task_yaml(work / "tasks", limit=len(items))
        for fmt in tqdm(list(FORMATS), desc="formats"):
            rows.append(compare_format(fmt, items, tasks, work))
    base = rows[0]
    for r in rows:
        r["acc_change_vs_fp32"] = r["in_process_acc"] - base["in_process_acc"]
        shifts = [abs(a - b) for x, y in zip(r["_ll"], base["_ll"]) for a, b in zip(x, y)]
        r["mean_abs_ll_shift_vs_fp32"] = sum(shifts) / len(shifts)
    for r in rows:
        del r["_ll"]
    print_table(rows)
    res = {"task": TASK, "num_items": len(items), "rows": rows,
           "outputs_match": all(r["agree"] for r in rows), "environment": environment()}
    write_results(args.json, res, chart)
    return 0 if res["outputs_match"] else 1

"""Workers started by torchrun (``distributed_executor_backend="external_launcher"``): two
"nodes" on loopback, one process each, run ``labkit generate --tp 2 --enable-expert-parallel``
on a tiny random Qwen3-MoE; rank 0 prints what one process prints, and both processes end."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from labkit import LLM
from labkit.cli import main
from labkit.model.testing import tiny_moe_checkpoint
from labkit.parallel.launch import torchrun_env
from labkit.parallel.workers import WorkerError

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
TORCHRUN = Path(sys.executable).with_name("torchrun")
PROMPT = "t5 t17 t3 t200 t9"
ARGS = ["--tp", "2", "--enable-expert-parallel", "--max-tokens", "6", "--dtype", "float32"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(folder: Path, port: int, timeout_s: float = 240,
            command: tuple[str, ...] = ()) -> list[tuple[int, str, str]]:
    """Both torchrun "nodes" (rank = node rank) running ``command`` (default: labkit generate
    at EP=2 on ``folder``); every process stopped on return."""
    command = command or ("-m", "labkit.cli", "generate", PROMPT, "--model", str(folder), *ARGS)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    procs = [subprocess.Popen(
        [str(TORCHRUN), "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(r),
         "--master-addr", "127.0.0.1", "--master-port", str(port), *command],
        env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True) for r in (0, 1)]
    try:
        out = [p.communicate(timeout=timeout_s) for p in procs]
        return [(p.returncode, o, e) for p, (o, e) in zip(procs, out)]
    finally:
        for p in procs:  # a hung run: end the process group this test started, by its id
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(10)


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside python")
def test_two_nodes_on_loopback_equal_one_process(tmp_path, capsys):
    _, folder = tiny_moe_checkpoint(tmp_path / "qwen3moe", "qwen3_moe", seed=7)
    assert main(["generate", PROMPT, "--model", str(folder), "--max-tokens", "6",
                 "--dtype", "float32"]) == 0
    reference = capsys.readouterr().out
    assert reference.startswith(PROMPT) and len(reference.split()) > len(PROMPT.split())
    (rc0, out0, err0), (rc1, out1, err1) = _launch(folder, _free_port())
    assert rc0 == 0, err0[-3000:]
    assert rc1 == 0, err1[-3000:]
    assert out0 == reference  # greedy, EP=2 over two launched processes = one process
    assert out1 == ""         # rank 1 only served rank 0's calls


def test_external_launcher_needs_torchrun(tmp_path, monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    assert torchrun_env() is None
    _, folder = tiny_moe_checkpoint(tmp_path / "m", "qwen3_moe", seed=1)
    with pytest.raises(WorkerError, match="rank 0 of a torchrun job of 2"):
        LLM(str(folder), tensor_parallel_size=2, enable_expert_parallel=True,
            distributed_executor_backend="external_launcher")


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed beside python")
def test_a_raising_rank_is_a_worker_error_and_every_process_ends(tmp_path):
    """Rank 1 raises in a call: rank 0 gets WorkerError naming that rank and its error, the
    group is stopped (a later call is refused by name) and both processes exit."""
    _, folder = tiny_moe_checkpoint(tmp_path / "m", "qwen3_moe", seed=3)
    script = Path(__file__).with_name("torchrun_fail_script.py")
    (rc0, out0, err0), (rc1, _, err1) = _launch(folder, _free_port(),
                                                command=(str(script), str(folder)))
    assert rc0 == 0, err0[-3000:]
    assert rc1 == 0, err1[-3000:]
    assert "places 2" in out0
    assert "WorkerError rank 1 failed in fail: | RuntimeError: boom on purpose" in out0
    assert "after the launched ranks were stopped" in out0

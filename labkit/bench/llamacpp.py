"""Driving llama.cpp (llama-cpp-python) from labkit: always in a separate interpreter.

``find_llamacpp_python()`` picks the interpreter that has ``llama_cpp``: $LABKIT_LLAMACPP_PYTHON,
else the job's venv ``.venv-llamacpp`` at the repository root (tests/quant/run_llamacpp.sh makes
it). ``run_llamacpp(request)`` sends a request to :mod:`labkit.bench.llamacpp_worker` and returns
its reply; a worker killed by a signal raises :class:`LlamaCppCrashed` naming the signal, so a
segmentation fault inside llama.cpp is reported, not mistaken for a wrong answer.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path
from typing import Any

from labkit.paths import REPO_ROOT

WORKER = Path(__file__).with_name("llamacpp_worker.py")


class LlamaCppUnavailable(RuntimeError):
    """No interpreter with llama_cpp installed; the message says how to get one."""


class LlamaCppCrashed(RuntimeError):
    """The llama.cpp worker process died (e.g. SIGSEGV); .signal holds the signal's name."""

    def __init__(self, message: str, signal_name: str | None) -> None:
        super().__init__(message)
        self.signal = signal_name


def find_llamacpp_python() -> str | None:
    env = os.environ.get("LABKIT_LLAMACPP_PYTHON")
    candidates = [env] if env else [str(REPO_ROOT / ".venv-llamacpp" / "bin" / "python")]
    for c in candidates:
        if c and Path(c).is_file():
            ok = subprocess.run([c, "-c", "import llama_cpp"], capture_output=True, timeout=120)
            if ok.returncode == 0:
                return c
    return None


def cpu_has_amx() -> bool:
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def run_llamacpp(request: dict[str, Any], python: str | None = None,
                 timeout: float = 600) -> dict[str, Any]:
    """One worker process: request in, reply out (see llamacpp_worker for the format)."""
    python = python or find_llamacpp_python()
    if python is None:
        raise LlamaCppUnavailable("llama-cpp-python is not installed; run "
                                  "`bash tests/quant/run_llamacpp.sh --install-only` (builds it "
                                  "into .venv-llamacpp) or set LABKIT_LLAMACPP_PYTHON")
    threads = str(request.get("threads", 1))
    env = {**os.environ, "OMP_NUM_THREADS": threads}
    proc = subprocess.run([python, str(WORKER)], input=json.dumps(request), text=True,
                          capture_output=True, timeout=timeout, env=env)
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        raise LlamaCppCrashed(f"llama.cpp worker died with {name} on {request.get('model')}: "
                              f"{proc.stderr[-2000:]}", name)
    if proc.returncode != 0:
        raise RuntimeError(f"llama.cpp worker failed (rc {proc.returncode}): "
                           f"{proc.stderr[-2000:]}")
    return json.loads(proc.stdout)

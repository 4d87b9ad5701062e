"""``labkit bench serve-llamacpp``: labkit serve beside llama-cpp-python's OpenAI server on one
GGUF file, the same bounded load, both stopped afterwards.

The end-to-end test runs in tests/quant/run_llamacpp.sh's job (it builds llama-cpp-python with
its ``[server]`` extra into .venv-llamacpp); elsewhere it skips, saying why. What it checks is
behaviour, not speed (speed is the benchmark's report): every request of both servers
completes with the same number of tokens (equal work), the greedy texts of the two servers are
equal on the f32 file (same weights, same prompt ids; llama.cpp's default repetition penalty
turned off), the ratios are finite, and both processes have exited. The argument and failure
paths are tested in every run."""

from __future__ import annotations

import math
import os
import sys

import httpx
import pytest

from labkit.bench import serve_llamacpp as sl
from labkit.bench.llamacpp import LlamaCppUnavailable


def _server_python_or_skip() -> str:
    if not os.environ.get("LABKIT_LLAMACPP_PYTHON"):  # only the job script names it
        pytest.skip("llama-cpp-python is not installed (run tests/quant/run_llamacpp.sh, "
                    "which sets LABKIT_LLAMACPP_PYTHON)")
    try:
        return sl.find_llamacpp_server()
    except LlamaCppUnavailable as e:
        pytest.skip(str(e))


@pytest.mark.interop
@pytest.mark.slow
def test_side_by_side_on_one_gguf_file(monkeypatch):
    _server_python_or_skip()
    monkeypatch.setattr(sl, "QUICK", {"max_tokens": 16, "requests": {1: 3, 8: 8},
                                      "check_prompts": 3, "check_tokens": 24})
    ports = []
    real = sl.llamacpp_cmd
    monkeypatch.setattr(sl, "llamacpp_cmd", lambda *a: ports.append(a[2]) or real(*a))
    out = sl.run("f32", threads=1, quick=True)
    assert out["stopped"] == {"labkit": True, "llama.cpp": True}
    with pytest.raises(httpx.TransportError):  # nothing listens there any more
        httpx.get(f"http://127.0.0.1:{ports[0]}/v1/models", timeout=2)
    rows = {(r["backend"], r["concurrency"]): r for r in out["rows"]}
    assert set(rows) == {(b, c) for b in ("labkit", "llama.cpp") for c in (1, 8)}
    for (_, c), r in rows.items():
        n = {1: 3, 8: 8}[c]
        assert r["completed"] == n and r["failed"] == 0
        assert r["total_output_tokens"] == n * 16  # equal work on both sides
    assert out["greedy_same_text"] == out["greedy_checked"] == 3, out["greedy_texts"]
    for ratios in out["labkit_over_llamacpp"].values():
        assert all(v is not None and math.isfinite(v) and v > 0 for v in ratios.values())


def test_unavailable_is_named(monkeypatch, capsys):
    monkeypatch.setenv("LABKIT_LLAMACPP_PYTHON", sys.executable)  # labkit's: no llama_cpp
    with pytest.raises(LlamaCppUnavailable, match="run_llamacpp.sh"):
        sl.find_llamacpp_server()
    assert sl.main(["--quick"]) == 2
    assert "llama-cpp-python is not installed" in capsys.readouterr().out


def test_llamacpp_command_queues_instead_of_interrupting():
    cmd = sl.llamacpp_cmd("py", "m.gguf", 1234, 2, 1024)
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert cmd[:3] == ["py", "-m", "llama_cpp.server"]
    assert flags["--interrupt_requests"] == "False"  # else a new request cuts the stream
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "1234"
    assert flags["--n_threads"] == flags["--n_threads_batch"] == "2"
    repack = sl.llamacpp_cmd("py", "m.gguf", 1234, 2, 1024, no_repack=True)
    assert repack[1] == "-c" and "use_extra_bufts = False" in repack[2]
    compile(repack[2], "no_repack", "exec")

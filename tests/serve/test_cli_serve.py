"""``labkit serve MODEL --host 127.0.0.1 --port P`` as a real process: /health turns 200 once
loaded; SIGTERM drains (the stream in flight finishes, new requests get 503) and exits 0. The
engine loop runs in a thread here (`--engine-mode thread`); tests/serve/test_engine_process.py
drains the default, an engine process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from labkit.serve.launcher import free_port


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read()
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise AssertionError("server did not become healthy")


@pytest.mark.slow
def test_labkit_serve_process_drains_on_sigterm():
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "labkit.cli", "serve", "labkit-tiny",
                             "--host", "127.0.0.1", "--port", str(port), "--num-blocks", "64",
                             "--drain-timeout", "30", "--engine-mode", "thread"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        r = httpx.post(url + "/v1/completions", json={"model": "labkit-tiny", "prompt": "x = ",
                                                     "max_tokens": 4, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        # long enough to be in flight through the checks below on a fast CPU (80 tokens once
        # drained before the second request, and the server had exited: connection refused)
        body = {"model": "labkit-tiny", "prompt": "def f():", "max_tokens": 900, "stream": True,
                "ignore_eos": True}
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as resp:
            lines = resp.iter_lines()
            next(lines)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            assert httpx.get(url + "/health").status_code == 503
            assert httpx.post(url + "/v1/completions", json=body).status_code == 503
            rest = [ln for ln in lines if ln]
        assert rest[-1] == "data: [DONE]"
        assert json.loads(rest[-2][6:])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


@pytest.mark.slow
def test_labkit_serve_bad_arguments_exit_2(capsys):
    from labkit.serve.launcher import main

    for argv in (["no-such-model"], ["labkit-tiny", "--max-waiting", "0"],
                 ["labkit-tiny", "--policy", "lottery", "--num-blocks", "8"],
                 ["labkit-tiny", "--api-key", ":bob"], ["labkit-tiny", "--stream-interval", "0"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2, argv
        assert "error:" in capsys.readouterr().err

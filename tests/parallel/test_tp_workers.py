"""Worker failures never hang the driver or leave processes behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from labkit.model.loader import models_dir
from labkit.parallel.shard_worker import ShardFactory
from labkit.parallel.workers import WorkerError, WorkerGroup

pytestmark = pytest.mark.slow


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0): read its state
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def _group(checkpoints, world: int = 2) -> WorkerGroup:
    folder, model = checkpoints["llama_gqa"]
    return WorkerGroup(world, ShardFactory(model.config, folder=str(folder)), timeout_s=30)


def test_a_rank_that_raises_stops_all(checkpoints):
    g = _group(checkpoints)
    with pytest.raises(WorkerError, match="(?s)rank 0 failed in fail:.*boom"):
        g.call("fail", "boom")
    assert not any(p.is_alive() for p in g._procs)
    with pytest.raises(WorkerError, match="shut down"):
        g.call("kv_heads")


def test_a_rank_that_dies_stops_all(checkpoints):
    g = _group(checkpoints)
    with pytest.raises(WorkerError, match="died|failed"):
        g.call("crash")
    assert not any(p.is_alive() for p in g._procs)


def test_bad_checkpoint_fails_at_start(tmp_path, checkpoints):
    _, model = checkpoints["llama_gqa"]
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(WorkerError, match="failed in start"):
        WorkerGroup(2, ShardFactory(model.config, folder=str(tmp_path)), timeout_s=30)


def test_workers_exit_when_the_driver_is_killed(checkpoints):
    folder, _ = checkpoints["llama_gqa"]
    script = textwrap.dedent(f"""
        import json, sys, time
        from labkit.model.loader import load_config
        from pathlib import Path
        from labkit.parallel.shard_worker import ShardFactory
        from labkit.parallel.workers import WorkerGroup
        cfg = load_config(Path({str(folder)!r}))
        g = WorkerGroup(2, ShardFactory(cfg, folder={str(folder)!r}), timeout_s=30)
        print(json.dumps(g.pids), flush=True)
        time.sleep(60)
    """)
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        line = driver.stdout.readline()
        pids = [int(p) for p in line.strip("[]\n").split(",")]
        assert all(_alive(p) for p in pids)
        driver.send_signal(signal.SIGKILL)
        driver.wait(10)
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids), "workers outlived their driver"
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait(5)


def test_an_interrupted_call_stops_the_workers(checkpoints):
    """Ctrl-C in a notebook interrupts the driver mid-call: that call's answers would still be
    in the pipes for the next call to misread, so the group stops its workers and says so."""
    import _thread
    import threading

    g = _group(checkpoints, world=1)  # one worker shows it (and starts in half the time)
    timer = threading.Timer(0.3, _thread.interrupt_main)
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            g.call("wait", 2.0)
    finally:
        timer.cancel()
    assert not any(p.is_alive() for p in g._procs)
    with pytest.raises(WorkerError, match="build a new LLM"):
        g.call("kv_heads")


def test_ctrl_c_in_a_terminal_leaves_no_process(checkpoints, tmp_path):
    """Ctrl-C in a terminal sends SIGINT to the driver and its workers together (one process
    group), here in the middle of LLM.generate: the driver exits, and so does every worker."""
    folder, _ = checkpoints["llama_gqa"]
    script = textwrap.dedent(f"""
        import json
        from pathlib import Path
        from labkit import LLM, SamplingParams
        from labkit.model.loader import CheckpointHandle, load_config
        handle = CheckpointHandle(load_config(Path({str(folder)!r})), Path({str(folder)!r}))
        llm = LLM((handle, None), tensor_parallel_size=2)
        print(json.dumps(llm.llm_engine.executor.runner.workers.pids), flush=True)
        while True:
            llm.generate(prompt_token_ids=[[1, 2, 3] * 10],
                         sampling_params=SamplingParams(temperature=0, max_tokens=50))
    """)
    err = open(tmp_path / "stderr", "w+")
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE,
                              stderr=err, text=True, start_new_session=True)
    try:
        pids = [int(p) for p in driver.stdout.readline().strip("[]\n").split(",")]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        time.sleep(0.5)  # inside generate
        os.killpg(driver.pid, signal.SIGINT)
        assert driver.wait(30) != 0
        deadline = time.monotonic() + 15
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids), "workers outlived Ctrl-C"
        err.seek(0)
        assert "KeyboardInterrupt" in err.read()
    finally:
        if driver.poll() is None:
            os.killpg(driver.pid, signal.SIGKILL)
            driver.wait(5)
        err.close()


def test_a_script_without_a_main_guard_is_told_how_to_fix_it(tmp_path):
    """Issue 27: ``LLM(..., tensor_parallel_size=2)`` at a script's top level failed with only
    ``rank 1 died (exit code 1) during start``. Spawned workers re-import the script; the
    driver now says so, with the guard to add and the worker's own report."""
    folder = models_dir() / "labkit-tiny"  # a folder with a tokenizer, as a user's would be
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        from labkit import LLM
        llm = LLM({str(folder)!r}, tensor_parallel_size=2)
        print("STARTED")
    """))
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=240, cwd=tmp_path)
    assert r.returncode != 0 and "STARTED" not in r.stdout
    err = r.stderr[r.stderr.rindex("WorkerError: rank"):]  # the driver's own exception
    assert "during start" in err and 'if __name__ == "__main__":' in err, r.stderr[-3000:]
    assert "re-ran the driver's script" in err  # what the worker itself reported
    assert "unguarded.py" in err  # ... with where in the script it happened
    guarded = tmp_path / "guarded.py"
    guarded.write_text(textwrap.dedent(f"""
        from labkit import LLM
        if __name__ == "__main__":
            llm = LLM({str(folder)!r}, tensor_parallel_size=2)
            print("STARTED", flush=True)
    """))
    r = subprocess.run([sys.executable, str(guarded)], capture_output=True, text=True,
                       timeout=240, cwd=tmp_path)
    assert r.returncode == 0 and "STARTED" in r.stdout, r.stderr[-3000:]

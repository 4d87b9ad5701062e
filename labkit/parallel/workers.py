"""N worker processes in one torch.distributed group, driven by method calls from the driver.

The driver (the engine) keeps the scheduler and the block tables; every step it sends the same
call to all ranks, each rank runs its shard (the collectives inside the forward meet across
ranks), and the driver reads rank 0's answer. That is vLLM's shape: one scheduler, N identical
workers.

Failure handling is the part that matters in practice. A rank that raises answers with its
traceback; a rank that dies is noticed by polling; either way the driver stops every worker and
raises ``WorkerError``. Workers watch their parent from a thread: if the driver is killed
(SIGKILL), they exit within a fraction of a second whatever they were doing (starting, waiting
in a collective) instead of lingering as orphans. Ctrl-C in a terminal reaches the driver and
the workers together: the workers ignore it (the driver decides), the driver's exit stops them.
Every wait is bounded.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import tempfile
import threading
import time
import traceback
import weakref
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from labkit.parallel.comm import TPGroup


class WorkerError(RuntimeError):
    """A tensor-parallel worker raised, died or stopped answering; all workers were stopped."""


_LOG_ENV = "LABKIT_TP_WORKER_LOG"  # where a spawned worker writes why it could not start

GUARD_ADVICE = (
    "The worker processes are started with Python's 'spawn' method, which re-imports your "
    "script in each worker. Your script creates the LLM at module level, so each worker tried "
    "to start workers of its own while it was still starting. Put the code that creates the "
    "LLM under a main guard:\n\n    if __name__ == \"__main__\":\n        llm = LLM(..., "
    "tensor_parallel_size=2)\n\n(vLLM asks the same; a notebook or `python -c` needs no guard.)")


def _check_not_bootstrapping() -> None:
    """Called before starting workers. In a spawned worker that is still re-importing the
    driver's script (multiprocessing's ``_inheriting``), starting workers means the script has
    no ``if __name__ == "__main__":`` guard: say so, in the worker's log for the driver too."""
    if not getattr(mp.current_process(), "_inheriting", False):
        return
    msg = "a tensor-parallel worker re-ran the driver's script and reached LLM(...) again. " + \
        GUARD_ADVICE
    log = os.environ.get(_LOG_ENV)
    if log:
        with open(log, "a") as f:
            f.write(msg + "\n" + "".join(traceback.format_stack()))
    raise WorkerError(msg)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _exit_with_parent(parent_pid: int) -> None:
    """Runs in a daemon thread: end this worker as soon as the driver is gone, whatever the
    main thread is blocked in (start-up, a collective waiting for a dead peer, a forward)."""
    while os.getppid() == parent_pid:
        time.sleep(0.25)
    os._exit(1)


def _worker_main(rank: int, world: int, port: int, factory: Callable[[TPGroup], Any],
                 conn: Any, parent_pid: int, timeout_s: float, backend: str) -> None:
    torch.set_num_threads(1)  # N ranks share the cores; one thread each avoids oversubscription
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the driver's to handle
    threading.Thread(target=_exit_with_parent, args=(parent_pid,), daemon=True).start()
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)  # rank r drives GPU r; NCCL needs it set before init
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s))
        target = factory(TPGroup(rank, world, distributed=True))
        conn.send(("ok", None))
    except BaseException:  # noqa: BLE001 - reported to the driver, which raises WorkerError
        conn.send(("err", traceback.format_exc()))
        return
    try:
        while True:
            method, args = conn.recv()  # the watchdog thread ends us if the driver dies
            if method == "__stop__":
                conn.send(("ok", None))
                return
            try:
                conn.send(("ok", getattr(target, method)(*args)))
            except BaseException:  # noqa: BLE001
                conn.send(("err", traceback.format_exc()))
    except (EOFError, BrokenPipeError):  # the driver closed the pipe
        return
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class WorkerGroup:
    """Start ``world`` processes, each holding ``factory(TPGroup(rank, world))``.

    ``call(method, *args)`` runs the method on every rank and returns the per-rank results.
    ``factory`` must be picklable (a module-level function or a functools.partial of one):
    workers are started with the ``spawn`` method, never ``fork``, so no lock or thread state
    of the driver is copied into them (nor a CUDA context, which cannot survive a fork).
    ``backend``: "gloo" (CPU tensors) or "nccl" (rank r on GPU r).
    """

    def __init__(self, world: int, factory: Callable[[TPGroup], Any],
                 timeout_s: float = 120.0, start_timeout_s: float = 300.0,
                 backend: str = "gloo") -> None:
        if backend not in ("gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
        _check_not_bootstrapping()
        ctx = mp.get_context("spawn")
        self.world, self.timeout_s = world, timeout_s
        port = _free_port()
        self._conns, self._procs = [], []
        self._logdir = tempfile.TemporaryDirectory(prefix="labkit-tp-")
        for rank in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, name=f"labkit-tp-{rank}", daemon=True,
                            args=(rank, world, port, factory, child, os.getpid(), timeout_s,
                                  backend))
            _start_with_log(p, self._log(rank))
            child.close()
            self._conns.append(parent)
            self._procs.append(p)
        self._finalizer = weakref.finalize(self, _stop_all, self._procs, self._conns)
        try:
            self._call("start", start_timeout_s)  # importing torch N times is slow on a busy box
        finally:
            self._logdir.cleanup()

    def _log(self, rank: int) -> str:
        return os.path.join(self._logdir.name, f"rank{rank}.log")

    def _died(self, rank: int, what: str) -> WorkerError:
        """The error for a rank that died: its exit code, and during start what it wrote (a
        worker that dies while re-importing the script never reaches the pipe)."""
        code = self._procs[rank].exitcode
        msg = f"rank {rank} died (exit code {code}) during {what}"
        if what == "start":
            try:
                with open(self._log(rank)) as f:
                    said = f.read().strip()
            except OSError:
                said = ""
            msg += (":\n" + said) if said else (
                ". Its own error, if it printed one, is above. If your script creates the LLM "
                "at module level: " + GUARD_ADVICE)
        return WorkerError(msg)

    def call(self, method: str, *args: Any) -> list[Any]:
        if not self._finalizer.alive:
            raise WorkerError("the worker group was shut down (by shutdown(), a failed rank or "
                              "an interrupted call); build a new LLM to start new workers")
        for c in self._conns:
            c.send((method, args))
        return self._call(method, self.timeout_s)

    def _call(self, what: str, timeout_s: float) -> list[Any]:
        try:
            return self._gather(what, timeout_s)
        except BaseException:
            # Ctrl-C (or any error) mid-call leaves this call's answers in the pipes, where the
            # next call would read them as its own: stop the group rather than reuse it.
            self.shutdown()
            raise

    def _gather(self, what: str, timeout_s: float) -> list[Any]:
        results: list[Any] = [None] * self.world
        pending = set(range(self.world))
        deadline = time.monotonic() + timeout_s
        while pending:
            for rank in sorted(pending):
                c = self._conns[rank]
                if c.poll(0.05):
                    try:
                        status, value = c.recv()
                    except (EOFError, OSError):  # the pipe closed: the process is gone
                        self._procs[rank].join(2.0)
                        self.shutdown()
                        raise self._died(rank, what) from None
                    if status == "err":
                        self.shutdown()
                        raise WorkerError(f"rank {rank} failed in {what}:\n{value}")
                    results[rank] = value
                    pending.discard(rank)
                elif not self._procs[rank].is_alive():
                    self.shutdown()
                    raise self._died(rank, what)
            if pending and time.monotonic() > deadline:
                self.shutdown()
                raise WorkerError(f"ranks {sorted(pending)} did not answer {what} within "
                                  f"{timeout_s:.0f} s")
        return results

    def shutdown(self) -> None:
        """Stop every worker (idempotent)."""
        self._finalizer()

    @property
    def alive(self) -> bool:
        return self._finalizer.alive and all(p.is_alive() for p in self._procs)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]


def _start_with_log(p: Any, log: str) -> None:
    """Start ``p`` with ``log`` in its environment (spawn copies the environment at start)."""
    old = os.environ.get(_LOG_ENV)
    os.environ[_LOG_ENV] = log
    try:
        p.start()
    finally:
        if old is None:
            del os.environ[_LOG_ENV]
        else:
            os.environ[_LOG_ENV] = old


def _stop_all(procs: list[Any], conns: list[Any]) -> None:
    for p, c in zip(procs, conns):
        if p.is_alive():
            try:
                c.send(("__stop__", ()))
            except (BrokenPipeError, OSError):
                pass
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(2.0)
    for c in conns:
        c.close()

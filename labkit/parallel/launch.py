"""Ranks started by ``torchrun``: the same workers, across machines.

:class:`~labkit.parallel.workers.WorkerGroup` spawns its N ranks itself, on one machine, and talks
to them through pipes. Across machines something else must start the processes: ``torchrun
--nnodes M --nproc-per-node G --node-rank i --master-addr A --master-port P`` starts G on each
node and tells every one its place through the environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``). vLLM calls that backend
``external_launcher``; so does labkit (``LLM(..., distributed_executor_backend=
"external_launcher")``, or ``labkit generate`` run under torchrun).

Rank 0 runs the engine and is also rank 0 of the model: :class:`LaunchedGroup` holds its shard
in-process and has :class:`WorkerGroup`'s interface (``call(method, *args)`` -> one answer per
rank), so the executor does not change. The other ranks run :func:`worker_loop`. There are no
pipes between machines, so the calls themselves travel over torch.distributed: rank 0 broadcasts
``(method, args)`` (``broadcast_object_list``), every rank runs it (the forward's collectives meet
as with spawned workers) and ``gather_object`` brings the answers back to rank 0. The first
broadcast is the rank recipe (the model folder, cache size, dtype): a worker needs nothing on its
command line but the device. Control messages go over gloo even when the tensors use NCCL.

Failure handling is what torch.distributed gives: a rank that raises answers with its traceback
(rank 0 raises ``WorkerError``, and stops the others); a rank that dies leaves the others in a
collective until the process group's timeout (``timeout_s``), after which they exit. Every wait
is bounded by it.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import traceback
from collections.abc import Callable
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from labkit.parallel.comm import TPGroup
from labkit.parallel.workers import WorkerError

_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
STOP = "__stop__"


def torchrun_env() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) when a launcher (torchrun) started this process with the
    env:// variables, else None."""
    if not all(k in os.environ for k in _ENV):
        return None
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])


def _init(backend: str, timeout_s: float) -> Any:
    """Join the launcher's process group; returns the gloo group control messages use."""
    env = torchrun_env()
    if env is None:
        raise WorkerError("external_launcher needs the variables torchrun sets (" +
                          ", ".join(_ENV) + "); start this process with torchrun")
    if backend == "nccl":
        torch.cuda.set_device(env[2])  # this node's GPU LOCAL_RANK
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://",
                                timeout=datetime.timedelta(seconds=timeout_s))
    return dist.new_group(backend="gloo") if backend == "nccl" else None


def _answer(target: Any, method: str, args: tuple) -> tuple[str, Any]:
    try:
        return "ok", getattr(target, method)(*args)
    except BaseException:  # noqa: BLE001 - reported to rank 0, which raises WorkerError
        return "err", traceback.format_exc()


def _where() -> str:
    return f"{socket.gethostname()} pid {os.getpid()}"


class LaunchedGroup:
    """Rank 0 of a torchrun job: :class:`WorkerGroup`'s interface over the launched ranks.

    ``factory`` is the rank recipe (picklable): rank 0 builds its own shard with it and
    broadcasts it for the others to build theirs."""

    def __init__(self, world: int, factory: Callable[[TPGroup], Any],
                 timeout_s: float = 300.0, backend: str = "gloo") -> None:
        env = torchrun_env()
        if env is None or env[0] != 0 or env[1] != world:
            raise WorkerError(f"external_launcher: this process must be rank 0 of a torchrun "
                              f"job of {world} processes (tensor_parallel_size); torchrun "
                              f"gave RANK/WORLD_SIZE {env[:2] if env else None}")
        self.world, self.timeout_s = world, timeout_s
        self._ctrl = _init(backend, timeout_s)
        self._open = True
        self.target: Any = None
        self._send(factory)
        status = _answer(factory, "__call__", (TPGroup(0, world, distributed=True),))
        self.target = status[1] if status[0] == "ok" else None
        self.places = self._gather("start", (status[0], _where() if self.target else status[1]))

    def _send(self, message: Any) -> None:
        dist.broadcast_object_list([message], src=0, group=self._ctrl)

    def _gather(self, what: str, mine: tuple[str, Any]) -> list[Any]:
        answers: list[Any] = [None] * self.world
        dist.gather_object(mine, answers, dst=0, group=self._ctrl)
        failed = [(r, a[1]) for r, a in enumerate(answers) if a[0] == "err"]
        if failed:
            self.shutdown()
            r, tb = failed[0]
            raise WorkerError(f"rank {r} failed in {what}:\n{tb}")
        return [a[1] for a in answers]

    def call(self, method: str, *args: Any) -> list[Any]:
        if not self._open:
            raise WorkerError("the launched ranks were stopped (shutdown() or a failed rank); "
                              "start the torchrun job again")
        self._send((method, args))
        return self._gather(method, _answer(self.target, method, args))

    def shutdown(self) -> None:
        """Tell every rank to leave its loop, then leave the process group (idempotent)."""
        if not self._open:
            return
        self._open = False
        try:
            self._send((STOP, ()))
            # A tensor-free collective last: gloo's worker thread drops the STOP broadcast's
            # work (and its Python-owned tensors, which needs the GIL) while this thread waits
            # here. Exiting right after the broadcast let that drop race the interpreter's
            # finalization: "terminate called without an active exception" (SIGABRT).
            dist.barrier(group=self._ctrl)
        finally:
            dist.destroy_process_group()

    @property
    def alive(self) -> bool:
        return self._open

    @property
    def pids(self) -> list[int]:
        return [os.getpid()]  # the others live on other machines: see ``places``


def worker_loop(device: str = "cpu", timeout_s: float = 300.0) -> int:
    """Ranks 1..N-1 of a torchrun job: build the shard rank 0's recipe describes, then run the
    calls rank 0 broadcasts until it says stop. Returns the process's exit code."""
    backend = "nccl" if torch.device(device).type == "cuda" else "gloo"
    torch.set_num_threads(max(1, torch.get_num_threads() // max(1, _local_world())))
    ctrl = _init(backend, timeout_s)
    rank, world = dist.get_rank(), dist.get_world_size()
    box: list[Any] = [None]
    try:
        dist.broadcast_object_list(box, src=0, group=ctrl)
        status = _answer(box[0], "__call__", (TPGroup(rank, world, distributed=True),))
        target = status[1] if status[0] == "ok" else None
        dist.gather_object((status[0], _where() if target else status[1]), None, dst=0,
                           group=ctrl)
        while True:  # after a failed start too: rank 0 answers it with STOP
            dist.broadcast_object_list(box, src=0, group=ctrl)
            method, args = box[0]
            if method == STOP:
                dist.barrier(group=ctrl)  # rank 0's last collective (LaunchedGroup.shutdown)
                return 0 if target is not None else 1
            dist.gather_object(_answer(target, method, args), None, dst=0, group=ctrl)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def exit_rank(code: int) -> NoReturn:
    """End a torchrun rank's process now: flush stdout and stderr, then ``os._exit(code)``,
    without the interpreter's finalization.

    Why: gloo's background threads outlive ``destroy_process_group`` by a moment, and one that
    releases a finished collective's Python-owned tensors while the interpreter finalizes
    aborts the process ("terminate called without an active exception", SIGABRT) after it
    did all its work. The barrier in :meth:`LaunchedGroup.shutdown` made that rare, not
    impossible (1 CI run in about 40 on 2 busy cores). Nothing is left to finalize: the group
    is gone and the output is flushed."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say there
            pass
    os._exit(code)


def _local_world() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

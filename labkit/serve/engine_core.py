"""EngineCore: the engine loop, run in a thread of the server or in its own process (vLLM V1).

The loop is the same in both places (:func:`run_engine_loop`): drain the commands queued since
the last step (add / abort / call / stop), run one ``engine.step()``, and emit that step's
outputs for every request plus the ``engine.stats()`` snapshot as ONE message. The front end
(:class:`~labkit.serve.async_llm.AsyncLLM`) turns messages into per-request streams; it never
touches the engine. Messages (all picklable):

- ``("reply", call_id, error, result)``: the answer to an add or a call;
- ``("step", t0, items, stats, outputs)``: ``items`` = ``(request_id, outputs, finished, error)``
  for each request the step (or an abort) touched; ``outputs`` = all of the step's StepOutputs;
- ``("dead", error)``: the loop stopped (shutdown, or an unrecoverable step error).

Why a process (``labkit serve``'s default, ``--engine-mode process``): the engine runs Python
(scheduler, model code between kernels) for most of a step, and in a thread it shares the GIL
with the event loop, so every SSE chunk, accept and JSON parse waits for the GIL and adds onto
the step (and the step onto them). In its own process the engine has a GIL to itself; the API
process only parses, streams and pickles. The price is one pickled message per step each way,
and the engine object is no longer inspectable from the server process (``call(fn)`` runs a
picklable ``fn`` there instead).

The process side (``_core_main``) builds its engine from an :class:`EngineSpec` (``spawn``: a
fresh interpreter, no forked torch state), sends a handshake (``max_model_len``, ``vocab_size``,
the tokenizer, the first stats), then loops. A reader thread drains the command pipe into a
queue, so the API process's sends never wait for a step to end (no pipe deadlock: the child
never blocks on reading while the parent blocks on writing). The child exits when told to
stop or when the command pipe reaches EOF (the API process died): no orphans. Ctrl-C is left
to the API process, which drains and then stops the child.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import pickle
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from labkit.engine.errors import EngineStepError
from labkit.engine.outputs import StepOutput
from labkit.serve.faults import inject_engine_process, maybe_slow_tokenizer
from labkit.utils import freeze_gc_heap

SWITCH_INTERVAL = 0.0005  # s; CPython's default is 0.005 (sys.getswitchinterval)


class EngineDeadError(RuntimeError):
    """The engine loop stopped (shut down, or an unrecoverable step error)."""


@dataclass
class EngineSpec:
    """What an engine process needs to build its engine: picklable, unlike the engine.

    ``engine_kw`` are :func:`build_engine`'s keyword arguments (LLMEngine's flags);
    ``num_threads`` sets ``torch.set_num_threads`` in the engine process (None: torch's
    default, which follows ``OMP_NUM_THREADS``)."""

    model: str
    dtype: str | None = None
    device: str | None = None
    engine_kw: dict[str, Any] = field(default_factory=dict)
    num_threads: int | None = None
    record_trace: bool = False  # a server runs for days: the trace would grow without bound


def build_engine(model: str, *, tokenizer: Any = None, dtype: str | None = None,
                 device: str | None = None, **engine_kw: Any) -> tuple[Any, Any, Any]:
    """(engine, tokenizer, chat template) for a shipped model name, a local folder or a
    ``.gguf`` file (memory-mapped; its chat template is the ChatML default)."""
    import torch

    from labkit.engine.llm_engine import LLMEngine
    from labkit.engine.model_setup import step_cures
    from labkit.model.loader import open_checkpoint
    from labkit.serve.engine_flags import (
        STEP_CURES,
        check_features,
        fold_kv_offload,
        fold_kv_role,
        load_for_serving,
    )

    kw = {k: v for k, v in engine_kw.items() if v is not None}
    check_features(model, kw)  # a combination that cannot run fails here, before loading
    fold_kv_offload(kw)  # --kv-offload-* -> kv_transfer_config
    fold_kv_role(kw, model)  # --kv-role / --kv-transfer-port -> the p2p connector
    quantization = kw.pop("quantization", None)
    fused, compile = (bool(kw.pop(k, False)) for k in STEP_CURES)
    if kw.get("tensor_parallel_size", 1) > 1:  # the worker processes read their own slices
        m, tok = open_checkpoint(model, getattr(torch, dtype) if dtype else None, device)
    else:
        m, tok = load_for_serving(model, quantization, dtype, device)
    step_cures(m, kw, fused, compile)  # --fused / --compile, as LLM(fused=, compile=)
    tok = maybe_slow_tokenizer(tokenizer or tok)  # LABKIT_FAULT=slow-tokenizer (triage lab)
    eng = LLMEngine.from_model(m, tok, name=str(model), **kw)
    return eng, tok, chat_template_for(model)


def chat_template_for(model: str) -> Any:
    """The chat template of a model folder (a ``.gguf`` file has no tokenizer_config.json
    beside it: ChatML). Needs no weights, so the API process of an engine process reads it."""
    from labkit.model.loader import resolve_model_path
    from labkit.serve.chat import load_chat_template

    gguf = str(model).endswith(".gguf")
    return load_chat_template(None if gguf else resolve_model_path(model))[0]


def _portable(exc: BaseException) -> BaseException:
    """``exc`` if it survives pickling, else a RuntimeError with its text (EngineStepError's
    ``__init__`` takes two arguments, which pickle does not pass back)."""
    try:
        pickle.loads(pickle.dumps(exc))
        return exc
    except Exception:  # noqa: BLE001 - any pickling failure
        return RuntimeError(f"{type(exc).__name__}: {exc}")


class EngineCore:
    """The engine side of the loop: applies commands and steps, emitting messages.

    Only this object touches the engine. It remembers each live request's ``n`` and which of
    its samples finished, so it knows when a request's last output is out and the engine may
    forget it (flat memory: vLLM frees a request's state when its output is returned)."""

    def __init__(self, engine: Any, emit: Callable[[tuple], None], *,
                 forget_finished: bool = True, portable_errors: bool = False) -> None:
        self.engine, self.emit = engine, emit
        self.forget_finished = forget_finished
        self.err = _portable if portable_errors else (lambda e: e)
        self.live: dict[str, tuple[int, set[int]]] = {}  # request id -> (n, finished samples)
        self.stopped = False

    def apply(self, cmd: tuple) -> None:
        eng, kind = self.engine, cmd[0]
        if kind == "add":
            _, cid, rid, prompt, params, priority, salt, lora = cmd
            try:
                if isinstance(prompt, list):
                    eng.add_request(rid, None, params, priority=priority, cache_salt=salt,
                                    prompt_token_ids=prompt, lora_request=lora)
                else:
                    eng.add_request(rid, prompt, params, priority=priority, cache_salt=salt,
                                    lora_request=lora)
            except Exception as e:  # noqa: BLE001 - the caller gets it as its answer
                self.emit(("reply", cid, self.err(e), None))
                return
            self.live[rid] = (params.n, set())
            self.emit(("reply", cid, None, rid))
        elif kind == "abort":
            self._abort(cmd[1])
        elif kind == "call":
            _, cid, fn = cmd
            try:
                self.emit(("reply", cid, None, fn(eng)))
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting caller
                self.emit(("reply", cid, self.err(e), None))
        elif kind == "stop":
            self.stopped = True

    def _abort(self, rid: str) -> None:
        req = self.live.pop(rid, None)
        if self.engine.abort(rid) and req is not None:
            outs = [StepOutput(rid, "", i, [], "", True, "abort") for i in range(req[0])
                    if i not in req[1]]
            self._forget([rid])
            self.emit(("step", 0.0, [(rid, outs, True, None)], self.engine.stats(), []))
        else:
            self._forget([rid])

    def step(self) -> None:
        eng, t0 = self.engine, time.monotonic()
        items: list[tuple] = []
        try:
            outputs = eng.step()
        except EngineStepError as e:  # those requests were aborted and freed; others go on
            err = self.err(e)
            items = [(rid, [], True, err) for rid in e.request_ids if self.live.pop(rid, 0)]
            self._forget(e.request_ids)
            outputs = []
        by_req: dict[str, list[StepOutput]] = {}
        for o in outputs:
            by_req.setdefault(o.request_id, []).append(o)
        done_ids = []
        for rid, outs in by_req.items():
            req = self.live.get(rid)
            if req is None:
                continue
            req[1].update(o.index for o in outs if o.finished)
            done = len(req[1]) >= req[0]
            if done:
                del self.live[rid]
                done_ids.append(rid)
            items.append((rid, outs, done, None))
        self._forget(done_ids)
        self.emit(("step", t0, items, eng.stats(), outputs))

    def _forget(self, request_ids: list[str]) -> None:
        """Their last output is on its way to the front end: the engine may drop them."""
        if self.forget_finished and request_ids:
            self.engine.forget_finished(list(request_ids))

    def fail_all(self, exc: BaseException, cmds: queue.SimpleQueue) -> None:
        """The loop is ending: abort what runs, answer queued adds / calls, say ``dead``."""
        for rid in list(self.live):
            self.engine.abort(rid)
        self._forget(list(self.live))
        self.live.clear()
        while True:
            try:
                cmd = cmds.get_nowait()
            except queue.Empty:
                break
            if cmd[0] in ("add", "call"):
                self.emit(("reply", cmd[1], exc, None))
        self.emit(("dead", exc))


def run_engine_loop(core: EngineCore, cmds: queue.SimpleQueue, idle_wait: float = 0.05) -> None:
    """The busy loop (thread or process): commands first, then one step, until stopped.

    Idle, it sleeps on the queue until a command comes; busy, it takes only what is already
    queued, so an abort queued during a step is applied right after it ("cancel = abort within
    one step") and a request's KV blocks are free before the next step is scheduled."""
    eng = core.engine
    dead: BaseException = EngineDeadError("engine loop shut down")
    while not core.stopped:
        try:
            cmd = cmds.get_nowait() if eng.has_unfinished_requests() else \
                cmds.get(timeout=idle_wait)
        except queue.Empty:
            cmd = None
        while cmd is not None and not core.stopped:
            core.apply(cmd)
            try:
                cmd = cmds.get_nowait()
            except queue.Empty:
                cmd = None
        if core.stopped or not eng.has_unfinished_requests():
            continue
        try:
            core.step()
        except Exception as e:  # noqa: BLE001 - the engine cannot go on: fail everything
            dead = EngineDeadError(f"engine step failed: {type(e).__name__}: {e}")
            break
    core.fail_all(dead, cmds)


# ---- the engine process --------------------------------------------------------------------
def _core_main(spec: EngineSpec, cmd_conn: Any, out_conn: Any) -> None:
    """The child process: build, handshake, loop; exit on stop or when the parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the API process drains, then stops us
    import torch

    if spec.num_threads:
        torch.set_num_threads(spec.num_threads)
    try:
        eng, tok, _ = build_engine(spec.model, dtype=spec.dtype, device=spec.device,
                                   **spec.engine_kw)
    except Exception as e:  # noqa: BLE001 - reported to the parent, which raises it
        out_conn.send(("failed", _portable(e)))
        return
    eng.record_trace = spec.record_trace
    frozen = freeze_gc_heap()  # no 100+ ms full collections of the startup heap under load
    inject_engine_process()  # LABKIT_FAULT=gc-storm undoes that (labkit.serve.faults)
    out_conn.send(("ready", {"max_model_len": eng.max_model_len, "vocab_size": eng.vocab_size,
                             "max_num_seqs": eng.config.scheduler.max_num_seqs,
                             "stats": dict(eng.stats()), "tokenizer": tok,
                             "num_threads": torch.get_num_threads(), "gc_frozen": frozen}))
    cmds: queue.SimpleQueue = queue.SimpleQueue()

    def read() -> None:  # never lets the parent's sends block on a busy engine
        try:
            while True:
                cmds.put(cmd_conn.recv())
        except (EOFError, OSError):  # the parent is gone: stop (no orphan)
            cmds.put(("stop",))

    def emit(msg: tuple) -> None:
        try:
            out_conn.send(msg)
        except (BrokenPipeError, OSError):
            core.stopped = True

    threading.Thread(target=read, name="labkit-core-reader", daemon=True).start()
    sys.setswitchinterval(SWITCH_INTERVAL)  # the reader gets the GIL soon after a command
    core = EngineCore(eng, emit, portable_errors=True)
    run_engine_loop(core, cmds)


class EngineCoreProc:
    """The API process's handle on an engine process: start + handshake, send, stop.

    ``out_conn`` is read by the front end's event loop (``loop.add_reader`` on its fd)."""

    def __init__(self, spec: EngineSpec, startup_timeout: float = 300.0) -> None:
        ctx = mp.get_context("spawn")
        self.cmd_conn, child_cmd = ctx.Pipe(duplex=False)[::-1]
        child_out, self.out_conn = ctx.Pipe(duplex=False)[::-1]
        # not a daemon: a daemonic process may not start children, and the engine starts its
        # tensor-parallel workers. We stop it at exit ourselves (atexit runs this before
        # multiprocessing's join of live children); if we die, its command pipe's EOF stops it
        self.proc = ctx.Process(target=_core_main, args=(spec, child_cmd, child_out),
                                name="labkit-engine-core", daemon=False)
        self.proc.start()
        atexit.register(self.stop, 5.0)
        child_cmd.close()  # ours closed: EOF reaches us when the child dies, and it when we die
        child_out.close()
        try:
            self.handshake = self._handshake(startup_timeout)
        except BaseException:
            self.stop(0)
            raise

    def _handshake(self, timeout: float) -> dict[str, Any]:
        if not self.out_conn.poll(timeout):
            raise RuntimeError(f"engine process did not start within {timeout} s")
        try:
            kind, payload = self.out_conn.recv()
        except EOFError:
            raise RuntimeError(f"engine process exited with {self.proc.exitcode} while "
                               "starting") from None
        if kind == "failed":
            raise payload
        return payload

    def send(self, cmd: tuple) -> None:
        self.cmd_conn.send(cmd)

    def alive(self) -> bool:
        return self.proc.is_alive()

    def stop(self, timeout: float = 10.0) -> int | None:
        """Ask it to stop, wait ``timeout`` s, then terminate / kill; always reaped."""
        atexit.unregister(self.stop)
        if self.proc.is_alive() and timeout > 0:
            try:
                self.cmd_conn.send(("stop",))
            except OSError:
                pass
            self.proc.join(timeout)
        for end in (self.proc.terminate, self.proc.kill):
            if self.proc.is_alive():
                end()
                self.proc.join(5)
        self.cmd_conn.close()
        self.out_conn.close()
        return self.proc.exitcode

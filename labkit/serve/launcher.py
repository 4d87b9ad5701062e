"""Start the server: ``labkit serve MODEL``, or in a background thread for tests and notebooks.

Graceful shutdown (SIGTERM / Ctrl-C): stop admitting (new requests and ``/health`` get 503, so a
load balancer takes the replica out), let the requests in flight finish for up to
``--drain-timeout`` seconds, then stop uvicorn and the engine core (thread or process); whatever
is still running then is aborted and freed. A second signal skips the drain.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import uvicorn

from labkit.serve.api_server import ServeConfig, build_app
from labkit.serve.async_llm import AsyncLLM
from labkit.serve.engine_core import EngineSpec, build_engine, chat_template_for
from labkit.serve.engine_flags import (
    FEATURE_FLAGS,
    add_feature_args,
    check_features,
    features_of,
    lora_modules_of,
)
from labkit.serve.faults import active_fault, inject_api_process
from labkit.serve.limits import parse_api_keys
from labkit.serve.read_timeout import read_timeout_protocol

ENGINE_FLAGS = ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "policy",
                "max_model_len", "preemption_mode", "num_cpu_blocks", "kv_cache_bytes",
                "tensor_parallel_size", "enable_expert_parallel", "tenant_weights",
                "tenant_max_running", "tenant_max_kv_blocks", "enable_chunked_prefill",
                *FEATURE_FLAGS)


class DrainingServer(uvicorn.Server):
    """uvicorn, with a drain phase between the first exit signal and the shutdown."""

    def __init__(self, config: uvicorn.Config, app: Any) -> None:
        super().__init__(config)
        self.state = app.state.serve
        self._drain: asyncio.Task | None = None

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.state.draining or self._drain is not None:
            super().handle_exit(sig, frame)  # second signal: stop now
            return
        self.begin_drain()

    def begin_drain(self) -> None:
        self.state.draining = True
        loop = asyncio.get_event_loop()
        self._drain = loop.create_task(self._wait_drained())

    async def _wait_drained(self) -> None:
        deadline = time.monotonic() + self.state.config.drain_timeout
        while self.state.llm.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.05)  # let the last responses flush
        self.should_exit = True


def uvicorn_config(app: Any, host: str, port: int, http: str = "auto",
                   **kw: Any) -> uvicorn.Config:
    """uvicorn's config for the app, its HTTP protocol bounding how long a request may take
    to arrive (``ServeConfig.request_read_timeout``; labkit.serve.read_timeout)."""
    state = app.state.serve
    timeout = state.config.request_read_timeout
    proto: Any = http if timeout is None else \
        read_timeout_protocol(timeout, http, on_timeout=state.on_read_timeout)
    return uvicorn.Config(app, host=host, port=port, http=proto, **kw)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerThread:
    """A server on 127.0.0.1 in a background thread (tests, benchmarks, notebooks)::

        with ServerThread(engine, tokenizer, ServeConfig(model_name="m")) as srv:
            httpx.get(srv.url + "/health")

    ``engine``: an LLMEngine (its loop runs in a thread here; ``srv.llm.engine`` is it) or an
    :class:`EngineSpec` (an engine process is started now; ``tokenizer=None`` then takes the
    process's). Leaving the block drains (bounded) and stops it; the thread is joined and the
    engine process, if any, stopped."""

    def __init__(self, engine: Any, tokenizer: Any, config: ServeConfig | None = None,
                 port: int | None = None, chat_template: Any = None,
                 http: str = "auto") -> None:
        self.llm = AsyncLLM(engine)
        if self.llm.process and tokenizer is None:
            tokenizer = self.llm.tokenizer
        self.app = build_app(self.llm, tokenizer, config, chat_template)
        self.state = self.app.state.serve
        self.port = port or free_port()
        ucfg = uvicorn_config(self.app, "127.0.0.1", self.port, http, log_level="warning",
                              timeout_graceful_shutdown=5, lifespan="on")
        self.server = DrainingServer(ucfg, self.app)
        self.server.install_signal_handlers = lambda: None  # not the main thread
        self.thread = threading.Thread(target=self.server.run, name="labkit-serve", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"server on port {self.port} did not start")
            time.sleep(0.02)
        return self

    def call(self, fn: Any, timeout: float = 30.0) -> Any:
        """Run ``fn(engine)`` in the engine core between steps (e.g. assert_no_leaks; a
        picklable ``fn`` for an engine process)."""
        fut = asyncio.run_coroutine_threadsafe(self.llm.call(fn), self.llm._loop)
        return fut.result(timeout)

    def drain(self) -> None:
        """Begin a graceful shutdown, as SIGTERM would."""
        loop = self.llm._loop
        if loop is not None:
            loop.call_soon_threadsafe(self.server.begin_drain)

    def stop(self, timeout: float = 30.0) -> None:
        if self.thread.is_alive():
            self.server.should_exit = True
            self.thread.join(timeout)
        if self.llm.core_proc is not None:  # never started, or the lifespan did not end it
            self.llm.core_proc.stop(5)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None)
    p.add_argument("--kv-cache-bytes", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--policy", default=None, help="fcfs | priority | sjf | fair (default "
                   "fcfs; fair when --tenant-weights is given)")
    p.add_argument("--tenant-weights", type=_weights_arg, default=None,
                   metavar="T=W,...", help="policy fair: each tenant's share of service "
                   "(tokens), e.g. a=2,b=1 (tenants are named by --api-key KEY:TENANT; "
                   "unlisted tenants weigh 1)")
    p.add_argument("--tenant-max-running", type=int, default=None, metavar="N",
                   help="per-tenant quota: at most N running sequences per tenant, any policy "
                   "(labkit/sched/quota.py)")
    p.add_argument("--tenant-max-kv-blocks", type=int, default=None, metavar="N",
                   help="per-tenant quota: a tenant starts a sequence only while it holds at "
                   "most N KV blocks with it")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction,
                   default=None, help="split long prompts into chunks of the token budget "
                   "(default on); --no-enable-chunked-prefill prefills each prompt in one step, "
                   "stalling every running decode for it (vLLM's flag)")
    p.add_argument("--preemption-mode", default="recompute", choices=["recompute", "swap"])
    p.add_argument("--num-cpu-blocks", type=int, default=0)
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None)
    p.add_argument("--tensor-parallel-size", "--tp", type=int, default=None, metavar="N",
                   help="split the model over N worker processes (labkit.parallel)")
    p.add_argument("--enable-expert-parallel", action="store_true", default=None,
                   help="with --tp N on an MoE model: place E/N whole experts on each worker, "
                   "tokens reach them by all-to-all (labkit.parallel.expert)")
    p.add_argument("--engine-mode", choices=("process", "thread"), default="process",
                   help="where the engine loop runs: its own process (default; vLLM's "
                   "EngineCore: no GIL shared with the HTTP loop) or a thread of the server")
    p.add_argument("--engine-process", dest="engine_mode", action="store_const",
                   const="process", help="same as --engine-mode process (the default)")
    p.add_argument("--engine-threads", type=int, default=None, metavar="N",
                   help="torch intra-op threads of the engine (default: torch's, which "
                   "follows OMP_NUM_THREADS)")
    add_feature_args(p)  # --quantization, --speculative-config, --kv-cache-dtype, ...


def parse_tenant_weights(spec: str) -> dict[str, float]:
    """``"a=2,b=1"`` -> ``{"a": 2.0, "b": 1.0}``; raises ValueError naming the bad part."""
    out: dict[str, float] = {}
    for part in spec.split(","):
        name, eq, w = part.strip().partition("=")
        try:
            weight = float(w)
        except ValueError:
            weight = float("nan")
        if not name or not eq or not 0 < weight < float("inf") or name in out:
            raise ValueError(f"--tenant-weights: {part.strip()!r} is not TENANT=WEIGHT with a "
                             "new tenant name and a finite weight > 0 (e.g. a=2,b=1)")
        out[name] = weight
    return out


def _weights_arg(spec: str) -> dict[str, float]:
    try:
        return parse_tenant_weights(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="labkit serve", description="An OpenAI-compatible server "
                                "over labkit's engine (SSE streaming, /metrics, rate limits).")
    p.add_argument("model", metavar="MODEL", help="shipped model name or a local HF folder")
    p.add_argument("--host", default="127.0.0.1", help="loopback unless you mean otherwise")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--max-waiting", type=int, default=None, help="queue length for 429")
    p.add_argument("--queue-timeout", type=float, default=None, metavar="S")
    p.add_argument("--request-timeout", type=float, default=None, metavar="S")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY[:TENANT]")
    p.add_argument("--rate-limit-rps", type=float, default=None, help="per key, requests/s")
    p.add_argument("--rate-limit-tps", type=float, default=None, help="per key, tokens/s")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20)
    p.add_argument("--drain-timeout", type=float, default=30.0, metavar="S")
    p.add_argument("--request-read-timeout", type=float, default=30.0, metavar="S",
                   help="a request's headers and body must arrive within S seconds of its "
                   "first byte (else 408 and the connection is closed; a connection that "
                   "sends nothing is closed after S seconds)")
    p.add_argument("--stream-interval", type=int, default=1, metavar="N",
                   help="tokens per SSE / WebSocket event (SGLang's flag): fewer bytes and "
                   "syscalls per token, burstier text; a choice's first and last events are "
                   "never held (labkit/serve/stream_interval.py)")
    add_engine_args(p)
    return p


def _positive(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    for name in ("max_waiting", "queue_timeout", "request_timeout", "rate_limit_rps",
                 "rate_limit_tps", "request_read_timeout"):
        v = getattr(args, name)
        if v is not None and not v > 0:
            p.error(f"--{name.replace('_', '-')} must be > 0, got {v}")
    if not 0 < args.port < 65536:
        p.error(f"--port must be in 1..65535, got {args.port}")
    if args.engine_threads is not None and args.engine_threads < 1:
        p.error(f"--engine-threads must be >= 1, got {args.engine_threads}")
    if args.stream_interval < 1:
        p.error(f"--stream-interval must be >= 1, got {args.stream_interval}")
    if args.tenant_weights and args.policy not in (None, "fair"):
        p.error(f"--tenant-weights needs --policy fair (got --policy {args.policy})")
    args.policy = args.policy or ("fair" if args.tenant_weights else "fcfs")


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    _positive(p, args)
    from labkit.model.loader import CheckpointError

    try:
        keys = parse_api_keys(args.api_key)
        unknown = sorted(set(args.tenant_weights or ()) - set(keys.values()))
        if unknown:  # a typo would silently weigh nobody
            raise ValueError(f"--tenant-weights names {unknown}, which no --api-key KEY:TENANT "
                             f"defines (tenants: {sorted(set(keys.values())) or 'none'})")
        lora_modules = lora_modules_of(args)
        active_fault()  # an unknown LABKIT_FAULT fails here, before an engine is built
        llm, tok, render = _engine_core(args)
        fault = inject_api_process()  # LABKIT_FAULT (the triage lab), once the engine is up
    except (CheckpointError, ValueError) as e:
        p.error(str(e))
    cfg = ServeConfig(args.served_model_name or str(args.model), args.max_waiting,
                      args.queue_timeout, args.request_timeout, keys, args.rate_limit_rps,
                      args.rate_limit_tps, args.max_body_bytes, drain_timeout=args.drain_timeout,
                      freeze_gc=fault != "gc-storm", request_read_timeout=args.request_read_timeout,
                      seed=args.seed, features=features_of(args), lora_modules=lora_modules,
                      stream_interval=args.stream_interval)
    app = build_app(llm, tok, cfg, render)
    server = DrainingServer(uvicorn_config(app, args.host, args.port, log_level="info",
                                           timeout_graceful_shutdown=5), app)
    print(f"labkit serve: {cfg.model_name} on http://{args.host}:{args.port}  "
          f"(blocks={llm.stats['num_blocks']}, policy={args.policy}, engine in a "
          f"{llm.mode})", flush=True)
    try:
        server.run()
    finally:  # the lifespan stops it; this covers a uvicorn that failed to start
        if llm.core_proc is not None:
            llm.core_proc.stop(5)
    return 0


def _engine_core(args: argparse.Namespace) -> tuple[AsyncLLM, Any, Any]:
    """(AsyncLLM, tokenizer, chat template): an engine process built from a spec, or an
    engine built here whose loop will run in a thread."""
    kw = {k: getattr(args, k) for k in ENGINE_FLAGS}
    check_features(args.model, kw)  # refused here, before an engine process starts
    if args.engine_mode == "process":
        llm = AsyncLLM(EngineSpec(args.model, args.dtype, args.device, kw,
                                  args.engine_threads))
        return llm, llm.tokenizer, chat_template_for(args.model)
    if args.engine_threads:
        import torch

        torch.set_num_threads(args.engine_threads)
    eng, tok, render = build_engine(args.model, dtype=args.dtype, device=args.device, **kw)
    eng.record_trace = False  # a server runs for days: the trace would grow without bound
    return AsyncLLM(eng), tok, render

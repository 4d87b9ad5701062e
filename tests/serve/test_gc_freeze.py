"""``freeze_gc_heap``: the startup heap leaves the collector's generations, so a full
collection under load walks only what requests created (the noisy neighbour's p99 tail was a
170 ms full collection of the server's startup heap). Counts, not timings."""

from __future__ import annotations

import gc

import pytest

from labkit.utils import freeze_gc_heap


@pytest.fixture
def unfrozen():
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_frozen_objects_leave_the_generations(unfrozen):
    keep = [[i] for i in range(20_000)]  # tracked containers, alive across the freeze
    before = len(gc.get_objects())  # the three generations, not the permanent one
    frozen = freeze_gc_heap()
    assert frozen >= 20_000 and frozen >= 0.9 * before
    assert len(gc.get_objects()) < 0.1 * before
    assert not any(o is keep[0] for o in gc.get_objects(generation=2))
    cycle: list = []
    cycle.append(cycle)  # created after the freeze: still collected as usual
    assert any(o is cycle for o in gc.get_objects(generation=0))
    del cycle
    assert gc.collect() >= 1


class _LLM:  # what ServerState reads and the lifespan's two calls, nothing else
    started, on_step, max_model_len, vocab_size, stats = False, None, 64, 10, {}
    mode, core_proc = "thread", None

    def start(self) -> None:
        self.started = True

    async def shutdown(self) -> None:
        pass


@pytest.mark.parametrize("freeze", [True, False])
def test_server_lifespan_freezes_the_api_process_when_asked(unfrozen, freeze):
    from fastapi.testclient import TestClient

    from labkit.serve.api_server import ServeConfig, build_app

    llm = _LLM()
    with TestClient(build_app(llm, None, ServeConfig(freeze_gc=freeze))):
        assert llm.started
        assert (gc.get_freeze_count() > 10_000) == freeze  # fastapi, torch, the app


def test_labkit_serve_asks_for_the_freeze(monkeypatch):
    from labkit.serve import launcher

    seen = {}
    llm = _LLM()
    llm.stats = {"num_blocks": 8}  # the start-up line prints it
    monkeypatch.setattr(launcher, "_engine_core", lambda args: (llm, None, None))
    monkeypatch.setattr(launcher.DrainingServer, "run",
                        lambda self: seen.update(cfg=self.state.config))
    assert launcher.main(["labkit-tiny", "--port", "1"]) == 0
    assert seen["cfg"].freeze_gc


def test_load_generator_freezes_while_any_load_runs(unfrozen):
    """Two loads at once (the two tenants): frozen until the LAST ends, then unfrozen."""
    import asyncio

    from aiohttp import web

    from labkit.bench.serve_client import BenchRequest, run_load

    seen: list[int] = []

    async def completions(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        await asyncio.sleep(0.01 * body["max_tokens"])  # the long load outlives the short one
        seen.append(gc.get_freeze_count())
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"choices": [{"text": "x"}]}\n\ndata: [DONE]\n\n')
        return resp

    async def main() -> tuple:
        app = web.Application()
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        try:
            return await asyncio.gather(
                run_load(url, "m", [BenchRequest("a", 1)] * 2, timeout=10),
                run_load(url, "m", [BenchRequest("b", 30)] * 2, timeout=10))
        finally:
            await runner.cleanup()

    short, long_ = asyncio.run(main())
    assert all(r.ok for r in short[0] + long_[0])
    assert len(seen) == 4 and min(seen) > 10_000  # the long load's replies came after the short
    assert gc.get_freeze_count() == 0  # ended: nothing left frozen


def test_labkit_router_freezes_before_serving(unfrozen, monkeypatch):
    import uvicorn

    from labkit.router import proxy

    seen = []
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: seen.append(gc.get_freeze_count()))
    assert proxy.main(["--replica", "http://127.0.0.1:9", "--probe-interval", "0"]) == 0
    assert seen and seen[0] > 10_000

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

"""Shared test set-up: CPU-friendly threads, the Triton interpreter when there is no GPU."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before triton is first imported anywhere in the test session.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# One thread per test process: the suite runs on 2 workers (pytest -n 2) on 2 cores, and
# the lab's tiny tensors gain nothing from intra-op threads.
torch.set_num_threads(1)

# The suite's time budget on CI's 2 cores (pytest -n 2). CI's own limit is 30 minutes for
# everything .ci/run does (installs and the interop jobs too), so the main suite gets 20. A full
# run prints where it stands; going over is a finding to fix (smaller shapes, shared fixtures,
# one server per module), not a number to raise.
SUITE_BUDGET_S = 20 * 60
_FULL_RUN = 1500  # tests run: below this it is a partial run, and the budget says nothing


def pytest_sessionstart(session):
    import time

    session.config._labkit_t0 = time.monotonic()


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    import time

    if getattr(config, "workerinput", None) is not None:
        return  # an xdist worker: the controller reports
    n = sum(len(terminalreporter.stats.get(k, ())) for k in ("passed", "failed", "error"))
    took = time.monotonic() - getattr(config, "_labkit_t0", time.monotonic())
    if n < _FULL_RUN:
        return
    verdict = "within" if took <= SUITE_BUDGET_S else "OVER"
    terminalreporter.write_sep("=", f"suite time {took:.0f} s: {verdict} its budget of "
                               f"{SUITE_BUDGET_S} s ({n} tests; tests/conftest.py)",
                               red=took > SUITE_BUDGET_S, green=took <= SUITE_BUDGET_S)



def _runs(item) -> bool:
    """The item will run: no skipif of it holds (its skip marks are plain booleans here)."""
    return not any(m.args and m.args[0] for m in item.iter_markers("skipif"))


def _heaviest_first(items: list) -> None:
    """Browser tests, then the other ``slow`` ones, then the rest (a stable sort): with the long
    tests first they are split between the two workers and the run ends on short ones
    (longest-processing-time-first, the classic makespan heuristic). That needs ``--dist
    worksteal`` (the README's command): xdist's default ``load`` queues most tests on a worker
    up front and never moves them, and a measured run ended with one worker idle for 10 of its
    49 minutes while 253 tests waited in the other's queue."""
    def rank(item) -> int:
        if item.get_closest_marker("browser"):
            return 0
        return 1 if item.get_closest_marker("slow") else 2
    items.sort(key=rank)


@pytest.hookimpl(trylast=True)  # after -m / -k deselection
def pytest_collection_modifyitems(config, items):
    """Run each of notebooks 00-05 once, not twice: when the learner-path test (Run All in
    JupyterLab, tests/notebooks/test_learner_path.py) is selected and its browser is installed,
    it executes them with the same environment and fails on any traceback, so the headless
    ``test_notebook_executes`` of those notebooks would only repeat it (~2.5 CPU-minutes).
    Deselect the learner path (``-m "not browser"``) or lack chromium, and they run headless."""
    _heaviest_first(items)
    learner = [i for i in items if i.nodeid.startswith("tests/notebooks/test_learner_path.py")
               and _runs(i)]
    if not learner:
        return
    covered = set(getattr(learner[0].module, "NOTEBOOKS", ()))
    skip = pytest.mark.skip(reason="executed in JupyterLab by tests/notebooks/"
                            "test_learner_path.py in this run")
    for item in items:
        if getattr(item, "originalname", "") == "test_notebook_executes" and \
                f"{item.callspec.id}.ipynb" in covered:
            item.add_marker(skip)

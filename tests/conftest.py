"""Shared test set-up: CPU-friendly threads, the Triton interpreter when there is no GPU."""

import os

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

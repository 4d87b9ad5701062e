#!/usr/bin/env bash
# Optional job: third-party clients against `labkit serve` — lm-evaluation-harness
# (`local-completions`, a multiple_choice task scored by echo + logprobs and a generate_until
# task) and guidellm (a synchronous benchmark run) — each a real install in its own venv, as users
# run them; the tests (tests/serve/test_client_interop.py) run in the lab's .venv and start the
# server themselves.
#   bash tests/serve/run_clients.sh               # create .venv-clients once, then run the tests
#   bash tests/serve/run_clients.sh --deps-only   # only make the venv (.ci/run does this early)
# Measured on 2 CPU cores: the venv installs in about 2 minutes (torch comes from the pin, CPU).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv-clients}
LABKIT_PY=${LABKIT_PY:-.venv/bin/python}
if [ ! -x "$VENV/bin/lm_eval" ] || [ ! -x "$VENV/bin/guidellm" ]; then
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  # torch from the lab's pin (the CPU build); an unpinned one would pull CUDA's multi-GB wheels
  "$VENV/bin/pip" install -q -c .ci/constraints.txt "lm-eval[api]==0.4.13" "guidellm==0.8.1"
fi
case "${1:-}" in --install-only|--deps-only) exit 0;; esac
export LABKIT_CLIENTS_VENV="$(cd "$VENV" && pwd)" OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec "$LABKIT_PY" -m pytest tests/serve/test_client_interop.py -m interop -q -rs -p no:xdist "$@"

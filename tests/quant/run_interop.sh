#!/usr/bin/env bash
# Optional job: labkit.quant against transformers + gptqmodel + autoawq, in an isolated venv
# (these pin their own transformers/accelerate/triton and must not touch the dev venv).
#   bash tests/quant/run_interop.sh            # creates $VENV once, then runs the tests
# Verified on 2 CPU cores, torch 2.13.0+cpu: 5 tests pass in 87 s on an otherwise idle
# machine (324 s while other jobs shared the cores); creating the venv takes a few minutes more.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv-interop}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0  # first, so no CUDA build of torch is pulled in
  "$VENV/bin/pip" install -q transformers==5.24.0 optimum==2.3.0 pytest safetensors tokenizers
  "$VENV/bin/pip" install -q gptqmodel==7.6.0
  "$VENV/bin/pip" install -q autoawq==0.2.9  # archived upstream; quantizes on CPU
fi
# --deps-only: .ci/run builds the venv while the main suite runs, before labkit is installed
[ "${1:-}" = "--deps-only" ] && exit 0
"$VENV/bin/pip" install -q --no-deps -e .
[ "${1:-}" = "--install-only" ] && exit 0
export GPTQMODEL_CPU_WORKERS=${GPTQMODEL_CPU_WORKERS:-2} OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
exec "$VENV/bin/python" -m pytest tests/quant/test_quant_interop.py -m interop -q -rs -s "$@"

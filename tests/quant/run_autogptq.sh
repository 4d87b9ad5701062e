#!/usr/bin/env bash
# Optional job: labkit's GPTQ checkpoints in AutoGPTQ 0.7.1 (archived upstream), in an isolated
# venv: it needs transformers 4.51.3 and peft 0.10.0, which must not touch the main environment.
#   bash tests/quant/run_autogptq.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv-autogptq}
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q torch==2.13.0  # first, so no CUDA build of torch is pulled in
  BUILD_CUDA_EXT=0 "$VENV/bin/pip" install -q transformers==4.51.3 auto-gptq==0.7.1 \
    peft==0.10.0 pytest scipy safetensors tokenizers tqdm numpy
fi
# --deps-only: .ci/run builds the venv while the main suite runs, before labkit is installed
[ "${1:-}" = "--deps-only" ] && exit 0
"$VENV/bin/pip" install -q --no-deps -e .
[ "${1:-}" = "--install-only" ] && exit 0
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
exec "$VENV/bin/python" -m pytest tests/quant/test_quant_autogptq.py -q -rs -p no:cacheprovider "$@"

#!/usr/bin/env bash
# Optional job: llama.cpp (llama-cpp-python) as labkit's peer on GGUF files.
#   bash tests/quant/run_llamacpp.sh                 # build/install once, then run the tests
#   bash tests/quant/run_llamacpp.sh --install-only  # only make .venv-llamacpp
# llama-cpp-python compiles llama.cpp from source (no wheels on PyPI). The build is kept lean
# (no llava/mtmd, tools, examples, tests or server) and the built wheel is cached under
# ~/.cache/labkit/wheels keyed by version, flags, CPU model and Python, so only the first run on
# a machine pays for it (measured: ~5 min on 2 idle cores; far more when the cores are shared).
# It is built for the machine's CPU (GGML_NATIVE, llama.cpp's default).
#
# Why q8_0 crashed on this CPU (AVX-512 + AMX): a native build compiles ggml's AMX backend, and
# at load time llama.cpp moves Q4_0/Q8_0/K-quant weights into an "AMX" buffer (repacked into AMX
# tile layout). The first matmul then dies inside ggml's AMX kernel: here with SIGILL, the kernel
# log saying "trap invalid opcode" at a `tilezero` in libggml-cpu.so (the issue's trial saw
# SIGSEGV; upstream ggml-org/llama.cpp issue 20824 reports a SIGSEGV in ggml_backend_amx_mul_mat).
# A standalone check on this VM shows AMX itself works (arch_prctl grants XTILEDATA, XCR0 has
# the tile bits, ldtilecfg + tilezero run) and that `tilezero` traps exactly so when no tile
# configuration is loaded: ggml executes tile ops without a valid tile config on that thread
# (it loads the config once per thread, `static thread_local bool done` in
# ggml_tile_config_init), so this is a ggml bug on its AMX path, not a problem of the file: the
# same q8_0/q4_0/q4_k_m files run correctly with weight repacking off. f32/f16 weights never go
# to the AMX buffer, which is why only quantized files crashed. The worker therefore loads with
# llama.cpp's --no-repack (use_extra_bufts = false) on AMX CPUs; a build without AMX
# (-DGGML_NATIVE=OFF with explicit AVX-512 flags and no GGML_AMX_*) would be the other fix.
#
# labkit runs in the main .venv; llama.cpp runs in .venv-llamacpp, in a separate process.
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${VENV:-.venv-llamacpp}
LABKIT_PY=${LABKIT_PY:-.venv/bin/python}
VERSION=0.3.36
LEAN="-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"
LEAN="$LEAN -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF"
BUILD_TIMEOUT=${BUILD_TIMEOUT:-1500}
CACHE=${LABKIT_WHEEL_CACHE:-$HOME/.cache/labkit/wheels}
KEY=$( { echo "$VERSION $LEAN"; uname -m; python3 -V; grep -m1 '^model name' /proc/cpuinfo;
         grep -m1 '^flags' /proc/cpuinfo; } | sha256sum | cut -c1-16)
WHEELS="$CACHE/llama-cpp-python-$VERSION-$KEY"

if ! ls "$WHEELS"/llama_cpp_python-*.whl >/dev/null 2>&1; then
  echo "building llama-cpp-python $VERSION (cached afterwards in $WHEELS)"
  mkdir -p "$WHEELS.tmp"
  python3 -m venv "$WHEELS.tmp/venv"
  "$WHEELS.tmp/venv/bin/pip" install -q --upgrade pip
  CMAKE_ARGS="$LEAN" CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
    timeout "$BUILD_TIMEOUT" "$WHEELS.tmp/venv/bin/pip" wheel -q --no-deps --no-binary :all: \
    -w "$WHEELS.tmp" "llama-cpp-python==$VERSION" \
    || { echo "llama-cpp-python did not build within ${BUILD_TIMEOUT}s"; exit 1; }
  mkdir -p "$WHEELS" && mv "$WHEELS.tmp"/llama_cpp_python-*.whl "$WHEELS"/
  rm -rf "$WHEELS.tmp"
fi
# the [server] extra (FastAPI, uvicorn, sse-starlette from PyPI) is llama-cpp-python's OpenAI
# server, which `labkit bench serve-llamacpp` and tests/quant/test_serve_llamacpp.py start
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c "import llama_cpp.server.app" 2>/dev/null
then
  [ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
  WHEEL=$(ls "$WHEELS"/llama_cpp_python-*.whl | head -1)
  "$VENV/bin/pip" install -q "$WHEEL[server]"
fi
case "${1:-}" in --install-only|--deps-only) exit 0;; esac
export LABKIT_LLAMACPP_PYTHON="$VENV/bin/python" OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
exec "$LABKIT_PY" -m pytest tests/quant/test_gguf_llamacpp.py tests/quant/test_serve_llamacpp.py \
  -m interop -q -rs -p no:xdist "$@"

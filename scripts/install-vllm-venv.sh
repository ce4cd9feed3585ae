#!/usr/bin/env bash
# Create a CPU-only virtualenv holding vLLM 0.33.0 (enough for the v1 Scheduler
# + KV connector machinery; no CUDA, no triton).
# Usage: scripts/install-vllm-venv.sh [VENV_PATH]   (default: <repo>/.venv-vllm)
# $TORCH: the torch requirement (the Makefile passes its pin; this default is the same).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$REPO_ROOT/.venv-vllm}"
TORCH="${TORCH:-torch==2.13.0}"
PY="$VENV/bin/python"

if [ -x "$PY" ] && "$PY" -c "import vllm" >/dev/null 2>&1; then
    echo "vllm already importable in $VENV; nothing to do"
    exit 0
fi

python3 -m venv "$VENV"
"$PY" -m pip install --quiet --upgrade pip
# Exact pin: resolves to a local CPU wheel. Plain `torch` would pull a multi-GB CUDA build.
"$PY" -m pip install --quiet "$TORCH"
# --no-deps: vllm's own requirement list drags in CUDA/triton wheels.
"$PY" -m pip install --quiet --no-deps "vllm==0.33.0"
"$PY" -m pip install --quiet \
    packaging "pydantic>=2.12.0" regex numpy cbor2 psutil "pyzmq>=25.0.0" \
    "requests>=2.33.0" "transformers>=5.16.1,<5.21.0" "aiohttp>=3.14.4" \
    "oss-harmony>=0.0.11" "openai>=2.25.0" "pillow>=13.0.0" pybase64 cachetools \
    msgspec cloudpickle uvloop py-cpuinfo "prometheus_client>=0.18.0" \
    "fastapi>=0.133.0,<0.137.0" partial-json-parser "llguidance>=1.7.0,<1.8.0" \
    einops pyyaml "apache-tvm-ffi==0.1.11"
# xgrammar's deps pull a ~1 GB triton; the scheduler import only needs the module.
"$PY" -m pip install --quiet --no-deps "xgrammar==0.2.8"

"$PY" -c "import vllm; print('vllm', vllm.__version__, 'installed in $VENV')"

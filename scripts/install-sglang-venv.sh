#!/usr/bin/env bash
# Create a CPU-only virtualenv holding SGLang's HiCache code (tests/sglang, `kvconn validate --engine sglang`):
# sglang 0.5.23 without its dependency list (which pins a CUDA torch 2.14.1, flashinfer, sgl-kernel ...),
# then only what importing its storage backend factory, host pools and HiCacheController needs, every version
# exact (scripts/sglang-constraints.txt), torch held at the pinned CPU build. torchvision has no build for this
# torch on the index: tests/sglang/standin holds a stand-in for that one import (docs/sglang.md says why).
# Usage: scripts/install-sglang-venv.sh [VENV_PATH]     (default <repo>/.venv-sglang)
# $TORCH: the torch requirement (the Makefile passes its pin; this default is the same).
set -euo pipefail

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${1:-$REPO_ROOT/.venv-sglang}"
TORCH="${TORCH:-torch==2.13.0}"
PY="$VENV/bin/python"
CONSTRAINTS="$REPO_ROOT/scripts/sglang-constraints.txt"
STANDIN="$REPO_ROOT/tests/sglang/standin"
CHECK="import sglang.srt.managers.cache_controller, sglang.srt.mem_cache.storage.backend_factory"

if [ -x "$PY" ] && PYTHONPATH="$STANDIN" "$PY" -c "$CHECK" >/dev/null 2>&1; then
    echo "SGLang already importable in $VENV; nothing to do"
    exit 0
fi

python3 -m venv "$VENV"
"$PY" -m pip install --quiet --upgrade pip
# Exact pin first: the CPU wheel from local disk. Unpinned, pip would pull a multi-GB CUDA build.
"$PY" -m pip install --quiet "$TORCH"
"$PY" -m pip install --quiet --no-deps "sglang==0.5.23"
# What SGLang's HiCache modules import (triton: sglang.srt.utils imports it at module level), and their own
# dependencies, all held to the constraints; torch stays the CPU build.
"$PY" -m pip install --quiet -c "$CONSTRAINTS" "$TORCH" \
    numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec pydantic pyzmq tqdm ipython \
    aiohttp transformers tokenizers dill apache-tvm-ffi sentencepiece compressed-tensors gguf
PYTHONPATH="$STANDIN" "$PY" -c "$CHECK; import sglang, torch; print('sglang', sglang.__version__, 'torch', torch.__version__, 'in $VENV')"

